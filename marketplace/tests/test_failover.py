"""Continuation failover at the service level: fencing, once per request, the money rules."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

import pytest
from django.utils import timezone

from billing import selectors as ledger
from conftest import make_host
from marketplace import services
from marketplace.lifecycle.claims import prompt_cache_key
from marketplace.models import Job, Request
from marketplace.tests.test_services import CHAT, submit
from testkit.evidence import drawn

if TYPE_CHECKING:
    from catalog.models import CatalogModel
    from testkit.personas import Customer, ServingHost

pytestmark = pytest.mark.django_db


def started(
    customer: Customer,
    catalog: CatalogModel,
    host: ServingHost,
    *,
    max_tokens: int = 50,
    prompt_tokens: int = 12,
    text: str = "The elephant wal",
) -> tuple[Request, Job]:
    request = submit(customer, catalog, max_tokens=max_tokens, prompt_tokens=prompt_tokens)
    job = services.job_claim_next(host=host.host, fingerprint=host.fingerprint)
    services.job_push_tokens(host=host.host, job_id=job.pk, seq=0, text=text)
    return request, job


class ContinuationTests:
    def test_a_dead_attempt_is_fenced_and_continued_from_the_exact_text(self, customer, serving_host, catalog) -> None:
        request, job = started(customer, catalog, serving_host)
        assert services.host_connection_lost(host_id=serving_host.host.pk) == 1
        with pytest.raises(services.JobNotRunning):
            services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=1, text="ked")
        with pytest.raises(services.JobNotRunning):
            services.job_complete(host=serving_host.host, job_id=job.pk, finish_reason="stop", token_ids=drawn(job.pk))
        rescuer = make_host(name="rescuer")
        started_at = Request.objects.get(pk=request.pk).started_at
        payload = services.job_claim_payload(host=rescuer.host, model_ids=[catalog.pk])
        continuation = Job.objects.select_related("request", "model").get(pk=payload["id"])
        key = prompt_cache_key(user_id=continuation.request.user_id, host_id=rescuer.host.pk)
        assert payload == services.job_payload(continuation, cache_key=key), "the long-poll's payload"
        assert payload["continuation"] and continuation.attempt == 2
        assert payload["messages"] == [*CHAT, {"role": "assistant", "content": "The elephant wal"}]
        assert payload["params"]["max_tokens"] == 50 - services.count_output(request, "The elephant wal")
        resumed = Request.objects.get(pk=request.pk)
        assert (resumed.status, resumed.started_at) == ("running", started_at), "a continuation keeps the start"

    def test_the_dead_host_gets_the_continuation_only_after_the_grace(
        self, customer, serving_host, catalog, settings
    ) -> None:
        settings.CONTINUATION_GRACE_SECONDS = 2
        started(customer, catalog, serving_host)
        services.host_connection_lost(host_id=serving_host.host.pk)
        assert services.job_claim_next(host=serving_host.host, fingerprint=serving_host.fingerprint) is None
        Job.objects.filter(status="queued").update(created_at=timezone.now() - timedelta(seconds=3))
        assert services.job_claim_next(host=serving_host.host, fingerprint=serving_host.fingerprint) is not None

    def test_a_second_death_fails_honestly_and_bills_nothing(self, customer, serving_host, catalog) -> None:
        request, _ = started(customer, catalog, serving_host)
        services.host_connection_lost(host_id=serving_host.host.pk)
        rescuer = make_host(name="rescuer")
        continuation = services.job_claim_next(host=rescuer.host, fingerprint=rescuer.fingerprint)
        services.job_push_tokens(host=rescuer.host, job_id=continuation.pk, seq=0, text="ked on")
        assert services.host_connection_lost(host_id=rescuer.host.pk) == 1
        request.refresh_from_db()
        assert (request.status, request.error_code, request.cost_ucents) == ("failed", "host_failed", 0)
        assert Job.objects.filter(request=request).count() == 2, "one continuation per request, never a relay"
        account = ledger.customer_account(user=customer.user)
        assert (account.balance_ucents, account.held_ucents) == (500_000_000, 0)

    def test_money_each_output_token_once_prompt_once_rescuer_paid_for_its_own(
        self, customer, serving_host, catalog
    ) -> None:
        request, _ = started(customer, catalog, serving_host, prompt_tokens=12, text="The elephant wal")
        services.host_connection_lost(host_id=serving_host.host.pk)
        rescuer = make_host(name="rescuer")
        continuation = services.job_claim_next(host=rescuer.host, fingerprint=rescuer.fingerprint)
        services.job_push_tokens(host=rescuer.host, job_id=continuation.pk, seq=0, text="ked slowly to the river.")
        done = services.job_complete(
            host=rescuer.host, job_id=continuation.pk, finish_reason="stop", token_ids=drawn(continuation.pk)
        )
        row = done.request
        whole = services.count_output(row, "The elephant walked slowly to the river.")
        own = services.count_output(row, "ked slowly to the river.")
        assert row.completion_tokens == whole and row.resumed
        assert row.cost_ucents == 12 * catalog.input_price_ucents + whole * catalog.output_price_ucents
        assert done.earned_ucents == own * catalog.output_price_ucents * 80 // 100
        assert ledger.host_account(host=rescuer.host).balance_ucents == done.earned_ucents
        assert ledger.host_account(host=serving_host.host) is None, "the dead host earns nothing"
        assert ledger.ledger_total() == 0 and ledger.cache_drift() == []

    def test_an_answer_that_used_its_whole_budget_settles_without_a_host(self, customer, serving_host, catalog) -> None:
        request, _ = started(customer, catalog, serving_host, max_tokens=2, text="one two three four")
        assert services.host_connection_lost(host_id=serving_host.host.pk) == 1
        request.refresh_from_db()
        assert (request.status, request.finish_reason, request.completion_tokens) == ("completed", "length", 2)
        assert ledger.host_account(host=serving_host.host) is None
        assert ledger.ledger_total() == 0

    def test_an_unclaimed_continuation_fails_honestly(self, customer, serving_host, catalog, settings) -> None:
        settings.QUEUE_TIMEOUT_SECONDS = 5
        request, _ = started(customer, catalog, serving_host)
        services.host_connection_lost(host_id=serving_host.host.pk)
        Job.objects.filter(status="queued").update(created_at=timezone.now() - timedelta(seconds=6))
        services.request_watch(request_id=request.pk)
        request.refresh_from_db()
        assert (request.status, request.error_code) == ("failed", "host_failed")
        assert "no other host took over" in request.error_message

    def test_the_stall_rule_continues_a_frozen_host(self, customer, serving_host, catalog, settings) -> None:
        settings.STALL_SECONDS = 20
        request, job = started(customer, catalog, serving_host)
        services.request_watch(request_id=request.pk)
        assert Job.objects.get(pk=job.pk).status == "running"
        Job.objects.filter(pk=job.pk).update(last_token_at=timezone.now() - timedelta(seconds=21))
        services.request_watch(request_id=request.pk)
        assert Job.objects.get(pk=job.pk).status == "failed"
        assert Job.objects.filter(request=request, attempt=2, status="queued").exists()


class SocketDropTests:
    def test_a_host_that_reopened_its_socket_in_time_keeps_its_job(self, customer, serving_host, catalog) -> None:
        from hosts.models import Host
        from hosts.services import host_socket_opened

        _, job = started(customer, catalog, serving_host)
        dropped = host_socket_opened(host_id=serving_host.host.pk)
        Host.objects.filter(pk=serving_host.host.pk).update(
            socket_since=dropped + timedelta(seconds=1)
        )  # it reconnected
        assert services.host_connection_lost(host_id=serving_host.host.pk, opened_at=dropped) == 0
        assert Job.objects.get(pk=job.pk).status == "running"
        assert (
            services.host_connection_lost(host_id=serving_host.host.pk, opened_at=dropped + timedelta(seconds=1)) == 1
        )
        assert Job.objects.get(pk=job.pk).status == "failed"


class RequeueBeforeFirstTokenTests:
    @pytest.mark.parametrize("death", ["connection", "reported", "silence"])
    def test_a_death_before_the_first_token_is_requeued_silently_and_the_continuation_stays_available(
        self, customer, serving_host, catalog, settings, death: str
    ) -> None:
        settings.CONTINUATION_GRACE_SECONDS = 0
        request = submit(customer, catalog)
        job = services.job_claim_next(host=serving_host.host, fingerprint=serving_host.fingerprint)
        if death == "connection":
            services.host_connection_lost(host_id=serving_host.host.pk)
        elif death == "reported":
            assert services.job_fail(host=serving_host.host, job_id=job.pk, reason="could not load") == "requeued"
        else:
            past_bound = settings.JOB_START_FLOOR_SECONDS + 1  # silent; its benchmark says it starts at once
            Job.objects.filter(pk=job.pk).update(claimed_at=timezone.now() - timedelta(seconds=past_bound))
            assert services.unstarted_job_end_one() is True
        request.refresh_from_db()
        assert (request.status, request.resumed) == ("running", False)
        rescuer = make_host(name="rescuer")
        payload = services.job_claim_payload(host=rescuer.host, model_ids=[catalog.pk])
        assert payload is not None and payload["continuation"] is False and payload["messages"] == CHAT
        assert payload["params"]["max_tokens"] == 20  # the whole budget: nothing was delivered
        services.job_push_tokens(host=rescuer.host, job_id=payload["id"], seq=0, text="Hello th")
        assert services.host_connection_lost(host_id=rescuer.host.pk) == 1  # then a death mid-answer: still continued
        request.refresh_from_db()
        assert (request.status, request.resumed) == ("running", True)
        third = make_host(name="third")
        continuation = services.job_claim_payload(host=third.host, model_ids=[catalog.pk])
        assert continuation["continuation"] is True and continuation["messages"][-1] == {
            "role": "assistant",
            "content": "Hello th",
        }

    def test_a_requeued_job_nobody_takes_fails_honestly_as_a_host_failure(
        self, customer, serving_host, catalog, settings
    ) -> None:
        request = submit(customer, catalog)
        job = services.job_claim_next(host=serving_host.host, fingerprint=serving_host.fingerprint)
        services.job_fail(host=serving_host.host, job_id=job.pk, reason="boom")
        Job.objects.filter(request=request, status="queued").update(created_at=timezone.now() - timedelta(hours=1))
        assert services.unclaimed_request_expire_one() is True
        request.refresh_from_db()
        assert (request.status, request.error_code, request.cost_ucents) == ("failed", "host_failed", 0)
        assert ledger.customer_account(user=customer.user).held_ucents == 0
