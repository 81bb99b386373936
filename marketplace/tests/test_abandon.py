"""A customer who goes away is not billed for what nobody reads (issue 17): once its
connection has been gone for ABANDON_GRACE_SECONDS without a re-attach, the job is
cancelled (its host is refused at its next batch and stops), the text delivered so far is
billed and paid for, and a job not yet claimed is withdrawn unbilled."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta

import httpx
import pytest
from django.utils import timezone

from billing import selectors as ledger
from billing.models import Hold
from billing.services import split_cost
from conftest import ROOT, make_customer, make_host, wait_until
from marketplace import services
from marketplace.models import Job, Request
from marketplace.tests.test_services import submit
from testkit.evidence import drawn

pytestmark = pytest.mark.django_db


def gone(request: Request, seconds: float = 60) -> None:
    Request.objects.filter(pk=request.pk).update(left_at=timezone.now() - timedelta(seconds=seconds))


class AbandonTests:
    def test_a_running_job_is_cut_at_what_was_delivered_and_its_host_paid_for_that(
        self, customer, serving_host, catalog
    ) -> None:
        request = submit(customer, catalog, max_tokens=200)
        job = services.job_claim_next(host=serving_host.host, fingerprint=serving_host.fingerprint)
        services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text="Once upon a time there was")
        services.request_listener_left(request_id=request.pk)
        assert services.abandoned_request_end_one() is False, "inside the grace: a dropped stream may re-attach"
        gone(request)
        assert services.abandoned_request_end_one() is True
        request.refresh_from_db()
        assert (request.status, request.finish_reason) == ("completed", "cancelled")
        assert 0 < request.completion_tokens < 200 and request.cost_ucents > 0
        assert Job.objects.get(pk=job.pk).earned_ucents == split_cost(request.cost_ucents).host_ucents
        with pytest.raises(services.JobNotRunning):  # the host is told at its next batch, and stops
            services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=1, text=" a king")
        assert request.cost_ucents < Hold.objects.get(pk=request.hold_id).amount_ucents
        assert ledger.reconcile_report() == []

    def test_a_queued_job_is_withdrawn_unbilled(self, customer, catalog) -> None:
        request = submit(customer, catalog)
        services.request_listener_left(request_id=request.pk)
        gone(request)
        assert services.watchdog_tick() >= 1
        request.refresh_from_db()
        assert (request.status, request.error_code, request.cost_ucents) == ("failed", "cancelled", 0)
        assert Job.objects.get(request=request).status == "failed"
        assert Hold.objects.get(pk=request.hold_id).status == Hold.Status.RELEASED

    def test_a_customer_who_re_attaches_in_time_keeps_the_request(self, customer, serving_host, catalog) -> None:
        request = submit(customer, catalog)
        services.job_claim_next(host=serving_host.host, fingerprint=serving_host.fingerprint)
        services.request_listener_left(request_id=request.pk)
        assert services.request_listener_here(request_id=request.pk) is True  # a re-attach clears it
        assert Request.objects.get(pk=request.pk).left_at is None
        assert services.abandoned_request_end_one() is False
        assert Request.objects.get(pk=request.pk).status == "running"

    def test_a_request_that_ended_is_never_touched(self, customer, serving_host, catalog) -> None:
        request = submit(customer, catalog)
        job = services.job_claim_next(host=serving_host.host, fingerprint=serving_host.fingerprint)
        services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text="Done.")
        services.job_complete(host=serving_host.host, job_id=job.pk, finish_reason="stop", token_ids=drawn(job.pk))
        assert services.request_listener_left(request_id=request.pk) is False
        assert services.abandoned_request_end_one() is False


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
class AbandonEndToEndTests:
    def test_hanging_up_a_stream_marks_the_request_and_the_host_stops_once_it_is_abandoned(
        self, gateway, catalog
    ) -> None:
        customer, serving = make_customer(), make_host(qualified=False, name="slow", trusted=True)
        sim = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "testkit.simhost",
                "--server",
                gateway.url,
                "--token",
                serving.token,
                "--model",
                "gemma-3-270m",
                "--loaded",
                "gemma-3-270m",
                "--wait",
                "2",
                "--stream-batches",
                "400",
                "--interval",
                "0.05",
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            assert sim.stdout is not None and json.loads(sim.stdout.readline()).get("ready")
            body = {
                "model": "gemma-3-270m",
                "messages": [{"role": "user", "content": "go on"}],
                "max_tokens": 3000,
                "stream": True,
            }
            with httpx.stream(
                "POST",
                f"{gateway.url}/v1/chat/completions",
                json=body,
                timeout=30,
                headers={"Authorization": f"Bearer {customer.secret}"},
            ) as response:
                texts = 0
                for line in response.iter_lines():
                    if line.startswith("data: ") and '"content"' in line:
                        texts += 1
                    if texts >= 5:
                        break  # the customer hangs up mid-answer
            request = wait_until(
                lambda: Request.objects.filter(left_at__isnull=False).first(),
                timeout=10,
                what="the gateway to notice the customer went away",
            )
            gone(request)
            assert services.abandoned_request_end_one() is True
            request.refresh_from_db()
            assert (request.status, request.finish_reason) == ("completed", "cancelled")
            job = Job.objects.get(request=request)
            wait_until(
                lambda: not Job.objects.filter(pk=job.pk, next_seq__gt=job.next_seq).exists() and sim.poll() is None,
                timeout=5,
                what="the host to stop",
            )
            assert request.completion_tokens < 3000 and ledger.reconcile_report() == []
        finally:
            sim.terminate()
            sim.wait(timeout=10)
