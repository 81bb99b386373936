"""Seed 001's "one continuation, then an honest error" (issue 33): deaths before any text are
requeued a bounded number of times and then end honestly, never as a `resumed` request with
nothing resumed; the one continuation has no requeues of its own."""

from __future__ import annotations

import pytest

from billing import selectors as ledger
from conftest import make_host
from marketplace import services
from marketplace.models import Job, Request
from marketplace.tests.test_services import submit

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _no_grace(settings) -> None:
    settings.CONTINUATION_GRACE_SECONDS = 0


def claim(serving) -> Job:  # noqa: ANN001
    job = services.job_claim_next(host=serving.host, fingerprint=serving.fingerprint)
    assert job is not None
    return job


class DeathsBeforeAnyTextTests:
    def test_requeues_are_bounded_then_the_request_fails_honestly_unresumed(
        self, customer, serving_host, catalog
    ) -> None:
        request = submit(customer, catalog)
        outcomes = [
            services.job_fail(host=serving_host.host, job_id=claim(serving_host).pk, reason="boom")
            for _ in range(services.MAX_REQUEUES + 1)
        ]
        assert outcomes == ["requeued"] * services.MAX_REQUEUES + ["failed"]
        request.refresh_from_db()
        assert (request.status, request.error_code, request.resumed, request.cost_ucents) == (
            "failed",
            "host_failed",
            False,
            0,
        )
        assert f"{services.MAX_REQUEUES + 1} hosts in a row failed before writing anything" in request.error_message
        assert not Job.objects.filter(request=request, attempt=2).exists(), "no continuation of nothing"
        assert ledger.customer_account(user=customer.user).held_ucents == 0
        assert ledger.reconcile_report() == []


class ContinuationDeathTests:
    def continued(self, customer, serving_host, catalog) -> tuple[Request, Job]:  # noqa: ANN001
        request = submit(customer, catalog)
        first = claim(serving_host)
        services.job_push_tokens(host=serving_host.host, job_id=first.pk, seq=0, text="Hello th")
        assert services.host_connection_lost(host_id=serving_host.host.pk) == 1
        rescuer = make_host(name="rescuer")
        return request, (rescuer, claim(rescuer))

    def test_a_continuation_whose_host_dies_before_its_first_token_is_not_requeued(
        self, customer, serving_host, catalog
    ) -> None:
        request, (rescuer, continuation) = self.continued(customer, serving_host, catalog)
        assert continuation.attempt == 2
        assert services.job_fail(host=rescuer.host, job_id=continuation.pk, reason="could not load") == "failed"
        request.refresh_from_db()
        assert (request.status, request.error_code, request.cost_ucents) == ("failed", "host_failed", 0)
        assert Job.objects.filter(request=request).count() == 2, "one continuation, then an honest error"
        assert ledger.customer_account(user=customer.user).held_ucents == 0

    def test_one_request_never_meets_more_than_max_requeues_plus_two_hosts(
        self, customer, serving_host, catalog
    ) -> None:
        request = submit(customer, catalog)
        for _ in range(services.MAX_REQUEUES):
            assert services.job_fail(host=serving_host.host, job_id=claim(serving_host).pk, reason="boom") == "requeued"
        last_try = claim(serving_host)
        services.job_push_tokens(host=serving_host.host, job_id=last_try.pk, seq=0, text="Hel")
        assert services.job_fail(host=serving_host.host, job_id=last_try.pk, reason="boom") == "continued"
        while (
            job := services.job_claim_next(host=serving_host.host, fingerprint=serving_host.fingerprint)
        ) is not None:
            services.job_fail(host=serving_host.host, job_id=job.pk, reason="boom")
        request.refresh_from_db()
        assert (request.status, request.resumed) == ("failed", True)
        assert Job.objects.filter(request=request).count() == services.MAX_REQUEUES + 2
