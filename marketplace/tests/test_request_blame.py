"""A customer's bad request never counts against a host (issue 17): a host that reports the
job's own content cannot be run gets no strike; another host gives a second opinion; two
hosts agreeing fail the request honestly and unbilled; a host that blamed a request another
host then served is counted as failing after all."""

from __future__ import annotations

import pytest

from billing import selectors as ledger
from billing.models import Hold
from conftest import make_customer, make_host
from hosts.models import Host
from marketplace import services
from marketplace.models import Job, Request
from marketplace.tests.test_services import submit
from testkit.evidence import drawn

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _no_grace(settings) -> None:
    settings.CONTINUATION_GRACE_SECONDS = 0


def claim(serving, catalog) -> Job:  # noqa: ANN001
    job = services.job_claim_next(host=serving.host, fingerprint=serving.fingerprint)
    assert job is not None
    return job


class RequestBlameTests:
    def test_blaming_the_request_is_no_strike_and_gets_a_second_opinion(self, catalog, settings) -> None:
        settings.HOST_MAX_FAILURES_PER_HOUR = 2
        honest = make_host(name="honest")
        for _ in range(settings.HOST_MAX_FAILURES_PER_HOUR + 2):
            request = submit(make_customer(), catalog)
            job = claim(honest, catalog)
            assert (
                services.job_fail(host=honest.host, job_id=job.pk, reason="temperature nan", cause="request")
                == "requeued"
            )
            request.refresh_from_db()
            assert request.status == "running" and Job.objects.filter(request=request, status="queued").exists()
            Job.objects.filter(
                request=request, status="queued"
            ).delete()  # (this test's next request, not a second opinion)
            Request.objects.filter(pk=request.pk).update(status="failed")
        assert Host.objects.get(pk=honest.host.pk).maintenance_since is None, "its strikes are the customers' faults"

    def test_two_hosts_agreeing_fail_the_request_honestly_and_unbilled(self, customer, catalog) -> None:
        first, second = make_host(name="first"), make_host(name="second")
        request = submit(customer, catalog)
        services.job_fail(
            host=first.host, job_id=claim(first, catalog).pk, reason="prompt past the context", cause="request"
        )
        assert (
            services.job_fail(
                host=second.host, job_id=claim(second, catalog).pk, reason="prompt past the context", cause="request"
            )
            == "failed"
        )
        request.refresh_from_db()
        assert (request.status, request.error_code, request.cost_ucents) == ("failed", "request_not_runnable", 0)
        assert "Two hosts could not run this request" in request.error_message
        assert "prompt past the context" not in request.error_message, "our words, not a host's"
        assert set(Job.objects.filter(request=request).values_list("fail_reason", flat=True)) == {
            "prompt past the context"
        }
        assert Hold.objects.get(pk=request.hold_id).status == Hold.Status.RELEASED
        assert ledger.reconcile_report() == []

    def test_a_host_that_blamed_a_request_another_host_served_is_counted_as_failing(self, customer, catalog) -> None:
        liar, honest = make_host(name="liar"), make_host(name="honest")
        request = submit(customer, catalog)
        blamed = claim(liar, catalog)
        services.job_fail(host=liar.host, job_id=blamed.pk, reason="cannot run this", cause="request")
        served = claim(honest, catalog)
        services.job_push_tokens(host=honest.host, job_id=served.pk, seq=0, text="Served just fine.")
        services.job_complete(host=honest.host, job_id=served.pk, finish_reason="stop", token_ids=drawn(served.pk))
        assert Request.objects.get(pk=request.pk).status == "completed"
        assert Job.objects.get(pk=blamed.pk).fail_cause == "host"

    @pytest.mark.django_db(transaction=True)  # an async view: its database threads must see the rows
    def test_the_host_api_takes_the_cause(self, customer, catalog) -> None:
        import json

        from django.test import Client

        serving = make_host()
        submit(customer, catalog)
        job = claim(serving, catalog)
        response = Client().post(
            f"/hosts/api/jobs/{job.pk}/fail",
            data=json.dumps({"reason": "bad top_p", "cause": "request"}),
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {serving.token}",
        )
        assert response.status_code == 200, response.content
        assert Job.objects.get(pk=job.pk).fail_cause == "request"
        response = Client().post(
            f"/hosts/api/jobs/{job.pk}/fail",
            data=json.dumps({"reason": "x", "cause": "weather"}),
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {serving.token}",
        )
        assert response.status_code == 400 and response.json()["error"]["param"] == "cause"
