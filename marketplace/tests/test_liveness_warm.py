"""Issue 50: a frozen host could hold a blank stream for its benchmark's load time (up to the
120 s allowance) even when its heartbeat said the model was loaded. A host whose fresh catalog
says the model is loaded when it claims has nothing to load: its start bound is its prefill for
this prompt (with the floor, and PROGRESS_STRETCH while it reports progress). A host cold at its
claim, or whose catalog is stale, keeps its load time; one that finishes loading after its claim
is not then held to a warm host's bound. And the timings these rules rest on, as mahout and the
gateway each name them, hold their relations."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from hosts.models import Host, Qualification
from hosts.services import host_heartbeat
from marketplace import services
from marketplace.models import Job, Request
from marketplace.tests.test_services import submit

pytestmark = pytest.mark.django_db

LOAD_MS = 60_000  # its benchmark's load: a minute; its other figures: 50 ms to first token, prompts at 500 tokens/s
COLD_BOUNDS = (
    pytest.approx(5 + 60 + 0.05 + 10 / 500),
    120,
)  # the floor, the load, 10 prompt tokens (stretched: capped)
WARM_BOUNDS = (pytest.approx(5 + 0.05 + 10 / 500), pytest.approx(5 + 3 * (0.05 + 10 / 500)))  # its prefill alone


@pytest.fixture(autouse=True)
def _clocks(settings, serving_host) -> None:
    settings.STALL_SECONDS = 20
    settings.JOB_START_FLOOR_SECONDS = 5
    settings.JOB_PROGRESS_SILENCE_SECONDS = 10
    settings.JOB_START_ALLOWANCE_SECONDS = 120
    settings.CONTINUATION_GRACE_SECONDS = 0
    settings.CATALOG_STALE_SECONDS = 15
    Qualification.objects.filter(host=serving_host.host).update(load_ms=LOAD_MS)


def heartbeat(serving_host, catalog, *, loaded: bool) -> None:
    """A heartbeat as mahout sends it, its catalog saying whether the model is loaded."""
    host_heartbeat(
        host=serving_host.host,
        fingerprint=serving_host.fingerprint,
        paused=False,
        version="1.0.0",
        models_loaded=[catalog.name] if loaded else [],
        catalog={
            "installed": [catalog.name],
            "qualified": [catalog.name],
            "loaded": [catalog.name] if loaded else [],
            "slots": 1,
            "active_jobs": 0,
        },
    )


def claimed(
    customer, catalog, serving_host, *, seconds_ago: float, progress_ago: float | None = None
) -> tuple[Request, Job]:
    request = submit(customer, catalog)
    job = services.job_claim_next(host=serving_host.host, fingerprint=serving_host.fingerprint)
    assert job is not None
    now = timezone.now()
    Job.objects.filter(pk=job.pk).update(
        claimed_at=now - timedelta(seconds=seconds_ago),
        last_token_at=now - timedelta(seconds=seconds_ago),
        progress_at=None if progress_ago is None else now - timedelta(seconds=progress_ago),
    )
    return request, Job.objects.get(pk=job.pk)


def aged(job: Job, *, seconds_ago: float, progress_ago: float | None = None) -> None:
    now = timezone.now()
    Job.objects.filter(pk=job.pk).update(
        claimed_at=now - timedelta(seconds=seconds_ago),
        progress_at=None if progress_ago is None else now - timedelta(seconds=progress_ago),
    )


class WarmStartBoundTests:
    def test_a_warm_host_that_goes_silent_after_claiming_is_cut_off_after_its_prefill(
        self, customer, catalog, serving_host
    ) -> None:
        heartbeat(serving_host, catalog, loaded=True)
        request, job = claimed(customer, catalog, serving_host, seconds_ago=4)
        assert job.loaded_at_claim is True
        assert services.job_start_bounds(job=job) == WARM_BOUNDS
        assert services.unstarted_job_end_one() is False, "inside its prefill bound"
        aged(job, seconds_ago=6)  # not the 65 s its load would have bought
        assert services.unstarted_job_end_one() is True
        request.refresh_from_db()
        assert (request.status, request.resumed) == ("running", False), "requeued silently, the continuation unspent"
        assert Job.objects.filter(request=request, status="queued", requeue=1).exists()
        assert "start bound" in Job.objects.get(pk=job.pk).fail_reason

    def test_progress_reports_buy_a_warm_host_only_its_stretched_prefill(self, customer, catalog, serving_host) -> None:
        """A frozen host whose progress thread still reports: before, 120 s of blank stream."""
        heartbeat(serving_host, catalog, loaded=True)
        request, job = claimed(customer, catalog, serving_host, seconds_ago=5, progress_ago=1)
        services.request_watch(request_id=request.pk)
        assert Job.objects.get(pk=job.pk).status == "running"
        aged(job, seconds_ago=6, progress_ago=0)
        services.request_watch(request_id=request.pk)  # a quiet stream's own check reaches the same verdict
        assert Job.objects.get(pk=job.pk).status == "failed"

    def test_a_cold_host_keeps_its_load_time(self, customer, catalog, serving_host) -> None:
        heartbeat(serving_host, catalog, loaded=False)
        _, job = claimed(customer, catalog, serving_host, seconds_ago=30, progress_ago=3)
        assert job.loaded_at_claim is False
        assert services.job_start_bounds(job=job) == COLD_BOUNDS
        assert services.unstarted_job_end_one() is False, "loading, and saying so"

    def test_a_host_that_finishes_loading_after_its_claim_keeps_its_load_time(
        self, customer, catalog, serving_host
    ) -> None:
        heartbeat(serving_host, catalog, loaded=False)
        _, job = claimed(customer, catalog, serving_host, seconds_ago=1)
        heartbeat(serving_host, catalog, loaded=True)  # loaded now: the job is prefilling after a load
        aged(job, seconds_ago=62, progress_ago=2)
        assert services.job_start_bounds(job=Job.objects.get(pk=job.pk)) == COLD_BOUNDS
        assert services.unstarted_job_end_one() is False

    def test_a_stale_catalog_is_not_taken_as_loaded(self, customer, catalog, serving_host) -> None:
        heartbeat(serving_host, catalog, loaded=True)
        Host.objects.filter(pk=serving_host.host.pk).update(catalog_at=timezone.now() - timedelta(seconds=16))
        serving_host.host.refresh_from_db()
        _, job = claimed(customer, catalog, serving_host, seconds_ago=1)
        assert job.loaded_at_claim is False, "possibly warm for routing, but not known to be loaded"
        assert services.job_start_bounds(job=job) == COLD_BOUNDS

    def test_a_warm_continuation_counts_its_delivered_text_but_no_load(self, customer, catalog, serving_host) -> None:
        heartbeat(serving_host, catalog, loaded=True)
        Qualification.objects.filter(host=serving_host.host).update(prompt_tps=10.0, ttft_ms=0)
        request, job = claimed(customer, catalog, serving_host, seconds_ago=1)
        services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text="x" * 30)
        services.host_connection_lost(host_id=serving_host.host.pk)
        heartbeat(serving_host, catalog, loaded=True)  # back, the model still loaded
        continuation = services.job_claim_next(host=serving_host.host, fingerprint=serving_host.fingerprint)
        assert continuation is not None and continuation.attempt == 2
        quiet, _ = services.job_start_bounds(job=Job.objects.get(pk=continuation.pk))
        assert quiet == pytest.approx(
            5 + (10 + 30) / 10.0
        )  # the floor, 10 prompt tokens and 30 delivered characters at 10/s
