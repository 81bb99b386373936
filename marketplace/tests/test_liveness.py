"""Liveness before the first token (seed 001, issues 16 and 33): the stall clock is a
stream's; a host loading a model or prefilling has its benchmark's bound plus a small floor,
and up to three times its figures while it reports progress, never past the start allowance."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from conftest import make_host
from hosts.models import Host, Qualification
from marketplace import services
from marketplace.models import Job, Request
from marketplace.tests.test_services import submit

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _clocks(settings) -> None:
    settings.STALL_SECONDS = 20
    settings.JOB_START_FLOOR_SECONDS = 5
    settings.JOB_PROGRESS_SILENCE_SECONDS = 10
    settings.JOB_START_ALLOWANCE_SECONDS = 120
    settings.CONTINUATION_GRACE_SECONDS = 0


def claimed(
    customer, catalog, serving_host, *, seconds_ago: float, progress_ago: float | None = None
) -> tuple[Request, Job]:
    request = submit(customer, catalog)
    job = services.job_claim_next(host=serving_host.host, fingerprint=serving_host.fingerprint)
    now = timezone.now()
    progress = None if progress_ago is None else now - timedelta(seconds=progress_ago)
    Job.objects.filter(pk=job.pk).update(
        claimed_at=now - timedelta(seconds=seconds_ago),
        last_token_at=now - timedelta(seconds=seconds_ago),
        progress_at=progress,
    )
    return request, Job.objects.get(pk=job.pk)


class StartBoundTests:
    def test_a_host_loading_for_30_seconds_while_reporting_progress_is_not_failed_over(
        self, customer, catalog, serving_host
    ) -> None:
        Qualification.objects.filter(host=serving_host.host).update(load_ms=20_000)  # its benchmark's load took 20 s
        request, job = claimed(customer, catalog, serving_host, seconds_ago=30, progress_ago=3)
        assert services.watchdog_tick() == 0
        services.request_watch(request_id=request.pk)
        assert Job.objects.get(pk=job.pk).status == "running"
        services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text="Once")  # loaded: the stream begins
        assert Job.objects.get(pk=job.pk).first_token_at is not None
        assert Job.objects.filter(host=serving_host.host, status="failed").count() == 0, "no failure strike"

    def test_a_host_that_goes_silent_while_loading_is_requeued_after_its_bound(
        self, customer, catalog, serving_host
    ) -> None:
        request, job = claimed(customer, catalog, serving_host, seconds_ago=4)
        assert services.watchdog_tick() == 0, "inside the bound: silence is allowed"
        Job.objects.filter(pk=job.pk).update(claimed_at=timezone.now() - timedelta(seconds=6))
        assert services.unstarted_job_end_one() is True
        request.refresh_from_db()
        assert (request.status, request.resumed) == ("running", False), "requeued silently, the continuation unspent"
        assert Job.objects.filter(request=request, status="queued", requeue=1, attempt=1).exists()
        assert "start bound" in Job.objects.get(pk=job.pk).fail_reason

    def test_the_bound_includes_the_hosts_own_load_time_and_prefill(self, customer, catalog, serving_host) -> None:
        Qualification.objects.filter(host=serving_host.host).update(load_ms=60_000, prompt_tps=1.0)
        request, job = claimed(
            customer, catalog, serving_host, seconds_ago=74
        )  # 5 s + 60 s load + 50 ms + 10 prompt tokens at 1/s
        assert services.job_start_bounds(job=job) == (pytest.approx(75.05), 120)
        services.request_watch(request_id=request.pk)
        assert Job.objects.get(pk=job.pk).status == "running"
        Job.objects.filter(pk=job.pk).update(claimed_at=timezone.now() - timedelta(seconds=76))
        services.request_watch(request_id=request.pk)
        assert Job.objects.get(pk=job.pk).status == "failed"

    def test_a_host_with_slots_gets_the_prefill_of_the_prompts_it_claimed_before(
        self, customer, catalog, serving_host
    ) -> None:
        Qualification.objects.filter(host=serving_host.host).update(prompt_tps=1.0)
        Host.objects.filter(pk=serving_host.host.pk).update(slots=3)
        _, first = claimed(customer, catalog, serving_host, seconds_ago=2)
        _, second = claimed(customer, catalog, serving_host, seconds_ago=1)
        alone = 5 + 0.05 + 10  # the floor, its first-token latency, its own 10 prompt tokens at 1/s
        assert services.job_start_bounds(job=first)[0] == pytest.approx(alone)
        assert services.job_start_bounds(job=second)[0] == pytest.approx(alone + 10), (
            "the first job's prompt is read too"
        )
        Job.objects.filter(pk=first.pk).update(first_token_at=second.claimed_at - timedelta(seconds=0.5))
        assert services.job_start_bounds(job=second)[0] == pytest.approx(alone), "started before: nothing ahead"

    def test_progress_never_outlives_the_start_allowance(self, customer, catalog, serving_host) -> None:
        Qualification.objects.filter(host=serving_host.host).update(
            load_ms=10**9
        )  # a host's own word buys at most the allowance
        _, job = claimed(customer, catalog, serving_host, seconds_ago=119, progress_ago=1)
        assert services.job_start_bounds(job=job) == (120, 120)
        assert services.unstarted_job_end_one() is False
        Job.objects.filter(pk=job.pk).update(claimed_at=timezone.now() - timedelta(seconds=121))
        assert services.unstarted_job_end_one() is True

    def test_the_stall_clock_runs_from_the_first_token(self, customer, catalog, serving_host) -> None:
        request, job = claimed(customer, catalog, serving_host, seconds_ago=5)
        services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text="Once upon")
        Job.objects.filter(pk=job.pk).update(last_token_at=timezone.now() - timedelta(seconds=21))
        assert services.unstarted_job_end_one() is False
        assert services.stalled_job_end_one() is True
        request.refresh_from_db()
        assert request.resumed, "after the first token a death spends the continuation"


class ProgressTests:
    def test_a_report_is_a_sign_of_life_for_the_hosts_own_running_job_only(
        self, customer, catalog, serving_host
    ) -> None:
        _, job = claimed(customer, catalog, serving_host, seconds_ago=1)
        services.job_progress(host=serving_host.host, job_id=job.pk)
        assert Job.objects.get(pk=job.pk).progress_at is not None
        with pytest.raises(services.HostRefused):
            services.job_progress(host=make_host(name="stranger").host, job_id=job.pk)
        services.job_fail(host=serving_host.host, job_id=job.pk, reason="out of memory")
        with pytest.raises(services.JobNotRunning):
            services.job_progress(host=serving_host.host, job_id=job.pk)


@pytest.mark.django_db(transaction=True)  # the async view reads through db()'s own threads
class ProgressApiTests:
    def test_the_host_reports_progress_over_http_and_strangers_and_ended_jobs_are_refused(
        self, customer, catalog, serving_host
    ) -> None:
        import json

        from django.test import Client

        _, job = claimed(customer, catalog, serving_host, seconds_ago=1)
        client, url = Client(), f"/hosts/api/jobs/{job.pk}/progress"

        def report(token: str, body: object) -> object:
            return client.post(
                url, data=json.dumps(body), content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {token}"
            )

        answer = report(serving_host.token, {"stage": "loading"})
        assert (answer.status_code, answer.json()) == (200, {"ok": True})
        assert Job.objects.get(pk=job.pk).progress_at is not None
        assert report(serving_host.token, {"stage": "napping"}).status_code == 400
        stranger = make_host(name="stranger")
        assert report(stranger.token, {}).json()["error"]["code"] == "not_your_job"
        services.job_fail(host=serving_host.host, job_id=job.pk, reason="gone")
        refused = report(serving_host.token, {})
        assert (refused.status_code, refused.json()["error"]["code"]) == (409, "job_not_running")


class FrozenBeforeTheFirstTokenTests:
    """Issue 33: progress buys time only within the host's own figures, above a small floor."""

    def test_a_frozen_host_reporting_progress_cannot_hold_a_blank_stream(self, customer, catalog, serving_host) -> None:
        request, job = claimed(customer, catalog, serving_host, seconds_ago=4, progress_ago=1)
        quiet, stretched = services.job_start_bounds(job=job)  # its figures: 50 ms to first token, 10 tokens at 500/s
        assert (quiet, stretched) == (pytest.approx(5.07), pytest.approx(5.21))
        assert services.unstarted_job_end_one() is False
        Job.objects.filter(pk=job.pk).update(
            claimed_at=timezone.now() - timedelta(seconds=6), progress_at=timezone.now()
        )
        assert services.unstarted_job_end_one() is True, "reporting progress, yet past three times its own figures"
        request.refresh_from_db()
        assert (request.status, request.resumed) == ("running", False)
        assert Job.objects.filter(request=request, status="queued", requeue=1).exists()

    def test_a_silent_host_with_no_load_and_a_tiny_prompt_is_found_at_the_floor(
        self, customer, catalog, serving_host
    ) -> None:
        Qualification.objects.filter(host=serving_host.host).update(load_ms=0, ttft_ms=0)
        _, job = claimed(customer, catalog, serving_host, seconds_ago=6)
        assert services.unstarted_job_end_one() is True, "not the old flat 20 s"

    def test_a_continuation_counts_the_delivered_text_as_prompt(self, customer, catalog, serving_host) -> None:
        Qualification.objects.filter(host=serving_host.host).update(prompt_tps=10.0, ttft_ms=0)
        request, job = claimed(customer, catalog, serving_host, seconds_ago=1)
        services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text="x" * 30)
        services.host_connection_lost(host_id=serving_host.host.pk)
        rescuer = make_host(name="rescuer")
        Qualification.objects.filter(host=rescuer.host).update(prompt_tps=10.0, ttft_ms=0)
        continuation = services.job_claim_next(host=rescuer.host, fingerprint=rescuer.fingerprint)
        assert continuation.attempt == 2
        quiet, _ = services.job_start_bounds(job=continuation)
        assert quiet == pytest.approx(
            5 + (10 + 30) / 10.0
        )  # the floor, then 10 prompt tokens and 30 delivered characters at 10/s

    def test_a_continuation_under_a_grammar_counts_the_delivered_text_at_generation_speed(
        self, customer, catalog, serving_host
    ) -> None:
        """Under a `response_format` the delivered text is written again, a token a step and
        unstreamed (`rewrite`), before the first new token: at the host's generation tokens/s,
        not its prefill's. (A ring on a slow machine took longer than its prefill figures allow
        and was failed over while writing it.)"""
        Qualification.objects.filter(host=serving_host.host).update(prompt_tps=10.0, ttft_ms=0)
        request, job = claimed(customer, catalog, serving_host, seconds_ago=1)
        services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text="x" * 30)
        services.host_connection_lost(host_id=serving_host.host.pk)
        rescuer = make_host(name="rescuer")
        Qualification.objects.filter(host=rescuer.host).update(prompt_tps=100.0, gen_tps=2.0, ttft_ms=0)
        continuation = services.job_claim_next(host=rescuer.host, fingerprint=rescuer.fingerprint)
        assert continuation.attempt == 2
        assert services.job_start_bounds(job=continuation)[0] == pytest.approx(
            5 + (10 + 30) / 100.0
        )  # without a grammar
        Request.objects.filter(pk=request.pk).update(
            params={**request.params, "response_format": {"type": "json_object"}}
        )
        quiet, stretched = services.job_start_bounds(job=continuation)
        assert quiet == pytest.approx(5 + 10 / 100.0 + 30 / 2.0)  # the floor, the prompt at 100/s, 30 characters at 2/s
        assert stretched == pytest.approx(5 + 3 * (10 / 100.0 + 30 / 2.0))
