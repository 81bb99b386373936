from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from billing import selectors as ledger
from billing.errors import InsufficientCredit, KeyLimitExceeded, TooManyStreams
from billing.models import Hold
from conftest import make_customer, make_host
from hosts.models import Host
from marketplace import services
from marketplace.lifecycle.claims import prompt_cache_key
from marketplace.models import Job, Request
from testkit.evidence import drawn
from testkit.personas import present
from testkit.requests import CHAT, submit_request

if TYPE_CHECKING:
    from catalog.models import CatalogModel
    from testkit.personas import Customer, ServingHost

pytestmark = pytest.mark.django_db


def submit(customer: Customer, catalog: CatalogModel, *, max_tokens: int = 20, prompt_tokens: int = 10) -> Request:
    """The streamed chat request these tests (and their importers) share."""
    return submit_request(
        customer,
        catalog,
        messages=CHAT,
        stream=True,
        seed=7,
        max_tokens=max_tokens,
        prompt_tokens=prompt_tokens,
    )


class AdmissionTests:
    def test_it_holds_the_upper_bound_and_queues_one_job(self, customer, catalog) -> None:
        request = submit(customer, catalog, max_tokens=20, prompt_tokens=10)
        assert request.estimate_ucents == 10 * catalog.input_price_ucents + 20 * catalog.output_price_ucents
        assert request.hold.amount_ucents == request.estimate_ucents
        assert list(request.jobs.values_list("status", flat=True)) == ["queued"]

    def test_it_queues_nothing_when_credit_does_not_cover_the_estimate(self, catalog) -> None:
        poor = make_customer(credit_ucents=100)
        with pytest.raises(InsufficientCredit):
            submit(poor, catalog)
        assert Request.objects.count() == 0 and Job.objects.count() == 0 and Hold.objects.count() == 0

    def test_it_queues_nothing_past_the_key_cap(self, catalog) -> None:
        capped = make_customer(cap_ucents=100)
        with pytest.raises(KeyLimitExceeded):
            submit(capped, catalog)
        assert Job.objects.count() == 0

    def test_it_holds_nothing_on_the_account_when_the_key_refuses_after_it(self, catalog) -> None:
        """The account's compare-and-set passes and the key's refuses (its cap): the chain's
        account update must be rolled back with the rest."""
        capped = make_customer(cap_ucents=100)
        with pytest.raises(KeyLimitExceeded):
            submit(capped, catalog)
        account = ledger.customer_account(user=capped.user)
        capped.key.refresh_from_db()
        assert (account.held_ucents, capped.key.held_ucents, Hold.objects.count(), Request.objects.count()) == (
            0,
            0,
            0,
            0,
        )

    def test_it_writes_the_hold_request_and_job_in_one_statement_on_postgresql(self, customer, catalog) -> None:
        """Admission is a chain of compare-and-sets and inserts: one round trip on PostgreSQL,
        five plain statements in one transaction elsewhere."""
        with CaptureQueriesContext(connection) as queries:
            request = submit(customer, catalog)
        writes = [
            q["sql"] for q in queries.captured_queries if q["sql"].split(" ", 1)[0] in ("WITH", "INSERT", "UPDATE")
        ]
        if connection.vendor == "postgresql":
            assert len(writes) == 1 and writes[0].startswith("WITH account AS (UPDATE")
        else:
            assert [w.split(" ", 1)[0] for w in writes] == ["UPDATE", "UPDATE", "INSERT", "INSERT", "INSERT"]
        customer.key.refresh_from_db()
        account = ledger.customer_account(user=customer.user)
        assert account.held_ucents == customer.key.held_ucents == request.estimate_ucents
        stored = Request.objects.select_related("hold").get(pk=request.pk)
        assert (stored.public_id, stored.params, stored.hold.amount_ucents, stored.hold.status) == (
            request.public_id,
            request.params,
            request.estimate_ucents,
            Hold.Status.ACTIVE,
        )
        job = Job.objects.get(request=request)
        assert job.status == Job.Status.QUEUED and job.max_chars is not None and job.deadline_at is not None

    def test_it_takes_the_locked_path_for_a_key_with_limits(self, catalog) -> None:
        limited = make_customer()
        limited.key.max_concurrent = 1
        limited.key.save(update_fields=["max_concurrent"])
        submit(limited, catalog)
        with pytest.raises(TooManyStreams):
            submit(limited, catalog)
        assert Request.objects.filter(api_key=limited.key).count() == 1


class ClaimTests:
    def test_it_gives_a_qualified_host_the_job_with_nothing_about_the_customer(
        self, customer, serving_host, catalog
    ) -> None:
        request = submit(customer, catalog)
        job = services.job_claim_next(host=serving_host.host, fingerprint=serving_host.fingerprint)
        payload = services.job_payload(job)
        assert set(payload) == {
            "id",
            "model",
            "kind",
            "messages",
            "prompt",
            "params",
            "continuation",
            "fragments",
            "end_of_turn",
        }
        assert set(payload["params"]) == {
            "max_tokens",
            "temperature",
            "top_p",
            "stop",
            "seed",
            "response_format",
            "logprobs",
        }
        assert payload["messages"] == CHAT and payload["model"] == "gemma-3-270m"
        flat = repr(payload)
        for secret in (customer.user.username, customer.key.prefix, request.public_id):
            assert secret not in flat
        request.refresh_from_db()
        assert request.status == "running"

    @pytest.mark.parametrize("kind", ["chat", "completion"])
    def test_the_long_poll_payload_is_the_stored_jobs_and_the_request_starts(
        self, customer, serving_host, catalog, kind
    ) -> None:
        request = submit_request(
            customer,
            catalog,
            kind=kind,
            messages=CHAT if kind == "chat" else None,
            prompt="Once upon" if kind == "completion" else None,
            max_tokens=9,
            temperature=0.5,
            top_p=0.9,
            stop=["\n"],
            seed=3,
            prompt_tokens=4,
        )
        payload = services.job_claim_payload(host=serving_host.host, model_ids=[catalog.pk])
        job = Job.objects.select_related("request", "model").get(pk=payload["id"])
        key = prompt_cache_key(user_id=customer.user.pk, host_id=serving_host.host.pk)
        assert payload == services.job_payload(job, cache_key=key)  # (the claiming host alone gets its key)
        assert (payload["kind"], payload["params"]["stop"], payload["continuation"]) == (kind, ["\n"], False)
        assert (job.status, job.host_id) == ("running", serving_host.host.pk)
        request.refresh_from_db()
        assert request.status == "running" and request.started_at is not None
        assert services.job_claim_payload(host=serving_host.host, model_ids=[catalog.pk]) is None, "nothing left"

    def test_it_refuses_a_host_on_a_machine_it_did_not_benchmark(self, customer, serving_host, catalog) -> None:
        submit(customer, catalog)
        assert services.job_claim_next(host=serving_host.host, fingerprint="0" * 64) is None
        unqualified = make_host(qualified=False, name="fresh")
        assert services.job_claim_next(host=unqualified.host, fingerprint=unqualified.fingerprint) is None
        assert Job.objects.get().status == "queued"

    def test_it_refuses_a_paused_host(self, customer, serving_host, catalog) -> None:
        submit(customer, catalog)
        Host.objects.filter(pk=serving_host.host.pk).update(paused=True)
        assert services.job_claim_next(host=serving_host.host, fingerprint=serving_host.fingerprint) is None
        Host.objects.filter(pk=serving_host.host.pk).update(paused=False)
        assert services.job_claim_next(host=serving_host.host, fingerprint=serving_host.fingerprint) is not None

    def test_it_lets_only_one_host_win_a_job(self, customer, serving_host, catalog) -> None:
        submit(customer, catalog)
        other = make_host(name="second")
        first = services.job_claim_next(host=serving_host.host, fingerprint=serving_host.fingerprint)
        second = services.job_claim_next(host=other.host, fingerprint=other.fingerprint)
        assert first is not None and second is None


def claimed(customer: Customer, serving_host: ServingHost, catalog: CatalogModel, **kwargs: int) -> tuple[Request, Job]:
    request = submit(customer, catalog, **kwargs)
    job = services.job_claim_next(host=serving_host.host, fingerprint=serving_host.fingerprint)
    return request, job


class TokenPushTests:
    def test_it_applies_batches_in_order_and_ignores_a_retry(self, customer, serving_host, catalog) -> None:
        request, job = claimed(customer, serving_host, catalog)
        host = serving_host.host
        assert services.job_push_tokens(host=host, job_id=job.pk, seq=0, text="Hel").accepted
        assert not services.job_push_tokens(host=host, job_id=job.pk, seq=0, text="Hel").accepted
        assert services.job_push_tokens(host=host, job_id=job.pk, seq=1, text="lo").next_seq == 2
        request.refresh_from_db()
        assert (request.delivered_text, request.delivered_chars) == ("Hello", 5)

    def test_a_nul_from_a_byte_level_model_is_dropped_not_stored(self, customer, serving_host, catalog) -> None:
        request, job = claimed(customer, serving_host, catalog)
        services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text="a\x00b")
        request.refresh_from_db()
        assert (request.delivered_text, request.delivered_chars) == ("ab", 2)

    def test_it_refuses_a_batch_from_the_future(self, customer, serving_host, catalog) -> None:
        _, job = claimed(customer, serving_host, catalog)
        with pytest.raises(services.SequenceGap):
            services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=3, text="x")

    def test_it_refuses_another_hosts_job(self, customer, serving_host, outsider, catalog) -> None:
        _, job = claimed(customer, serving_host, catalog)
        with pytest.raises(services.HostRefused):
            services.job_push_tokens(host=outsider.host, job_id=job.pk, seq=0, text="x")
        with pytest.raises(services.HostRefused):
            services.job_complete(host=outsider.host, job_id=job.pk, finish_reason="stop", token_ids=drawn(job.pk))
        with pytest.raises(services.HostRefused):
            services.job_fail(host=outsider.host, job_id=job.pk, reason="x")


class CompletionTests:
    def test_it_bills_counted_tokens_pays_80_percent_and_deletes_the_prompt(
        self, customer, serving_host, catalog
    ) -> None:
        request, job = claimed(customer, serving_host, catalog, max_tokens=50, prompt_tokens=12)
        services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text="Hello there, friend.")
        done = services.job_complete(
            host=serving_host.host, job_id=job.pk, finish_reason="stop", token_ids=drawn(job.pk)
        )
        row = done.request
        assert row.status == "completed" and row.messages is None and row.prompt is None
        assert 1 <= row.completion_tokens <= 50
        expected = 12 * catalog.input_price_ucents + row.completion_tokens * catalog.output_price_ucents
        assert row.cost_ucents == expected
        assert done.earned_ucents == expected * 80 // 100
        assert ledger.host_account(host=serving_host.host).balance_ucents == expected * 80 // 100
        assert ledger.customer_account(user=customer.user).balance_ucents == 500_000_000 - expected
        assert ledger.ledger_total() == 0 and ledger.cache_drift() == []

    def test_it_never_bills_more_than_max_tokens(self, customer, serving_host, catalog) -> None:
        _, job = claimed(customer, serving_host, catalog, max_tokens=3)
        # a count a little over (the gateway's count of a text may differ from the host's); far over is refused
        services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text="one two three four five")
        done = services.job_complete(
            host=serving_host.host, job_id=job.pk, finish_reason="length", token_ids=drawn(job.pk, ended=False)
        )
        assert done.request.completion_tokens == 3
        assert done.request.cost_ucents <= done.request.estimate_ucents

    def test_it_rejects_anything_after_the_end(self, customer, serving_host, catalog) -> None:
        _, job = claimed(customer, serving_host, catalog)
        services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text="Hello")
        services.job_complete(host=serving_host.host, job_id=job.pk, finish_reason="stop", token_ids=drawn(job.pk))
        with pytest.raises(services.JobNotRunning):
            services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text="late")

    def test_a_repeated_complete_returns_the_same_result_and_bills_once(self, customer, serving_host, catalog) -> None:
        _, job = claimed(customer, serving_host, catalog)
        services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text="Hello")
        first = services.job_complete(
            host=serving_host.host, job_id=job.pk, finish_reason="stop", token_ids=drawn(job.pk)
        )
        again = services.job_complete(
            host=serving_host.host, job_id=job.pk, finish_reason="stop", token_ids=drawn(job.pk)
        )
        assert again.earned_ucents == first.earned_ucents > 0
        assert ledger.host_account(host=serving_host.host).balance_ucents == first.earned_ucents

    def test_a_job_failed_twice_bills_nothing_and_releases_the_hold(self, customer, serving_host, catalog) -> None:
        request, job = claimed(customer, serving_host, catalog)
        services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text="partial")
        assert services.job_fail(host=serving_host.host, job_id=job.pk, reason="out of memory") == "continued"
        rescuer = make_host(name="rescuer")
        second = services.job_claim_next(host=rescuer.host, fingerprint=rescuer.fingerprint)
        services.job_push_tokens(
            host=rescuer.host, job_id=second.pk, seq=0, text=" more"
        )  # mid-answer: before it, a requeue
        assert services.job_fail(host=rescuer.host, job_id=second.pk, reason="out of memory too") == "failed"
        request.refresh_from_db()
        assert (request.status, request.error_code, request.cost_ucents, request.messages) == (
            "failed",
            "host_failed",
            0,
            None,
        )
        account = ledger.customer_account(user=customer.user)
        assert (account.balance_ucents, account.held_ucents) == (500_000_000, 0)
        assert ledger.host_account(host=serving_host.host) is None and ledger.host_account(host=rescuer.host) is None


class WatchdogTests:
    def test_it_expires_an_unclaimed_request_and_releases_its_hold(self, customer, catalog, settings) -> None:
        settings.QUEUE_TIMEOUT_SECONDS = 5
        request = submit(customer, catalog)
        assert services.unclaimed_request_expire_one() is False
        Job.objects.update(created_at=timezone.now() - timedelta(seconds=6))
        assert services.unclaimed_request_expire_one() is True
        request.refresh_from_db()
        assert (request.status, request.error_code) == ("failed", "queue_timeout")
        assert ledger.customer_account(user=customer.user).held_ucents == 0
        assert request.error_message == (
            "No host claimed this request within 5 seconds; nothing was billed. No host that "
            "serves gemma-3-270m is online now; GET /v1/models lists the models being served."
        )

    def test_a_queue_timeout_says_whether_hosts_were_online_but_busy(
        self, customer, serving_host, catalog, settings
    ) -> None:
        settings.QUEUE_TIMEOUT_SECONDS = 5
        present(serving_host)  # online (a fresh heartbeat), and it claims nothing
        request = submit(customer, catalog)
        Job.objects.update(created_at=timezone.now() - timedelta(seconds=6))
        assert services.unclaimed_request_expire_one() is True
        request.refresh_from_db()
        assert request.error_code == "queue_timeout"
        assert request.error_message.endswith(
            "1 host serving gemma-3-270m is online and it was busy; try again shortly."
        )

    def test_a_trusted_only_queue_timeout_says_so(self, customer, serving_host, catalog, settings) -> None:
        settings.QUEUE_TIMEOUT_SECONDS = 5
        present(serving_host)  # online (a fresh heartbeat), and it claims nothing
        request = submit(customer, catalog)
        Job.objects.update(created_at=timezone.now() - timedelta(seconds=6), trusted_only=True)
        assert services.unclaimed_request_expire_one() is True
        request.refresh_from_db()
        assert request.error_message.endswith(
            "but this request takes trusted hosts only and none of those was free; try again shortly."
        )

    def test_a_claim_that_wins_the_race_is_not_expired(self, customer, serving_host, catalog) -> None:
        request, _ = claimed(customer, serving_host, catalog)
        assert services.request_expire_unclaimed(request_id=request.pk) is False
        request.refresh_from_db()
        assert request.status == "running"

    def test_it_continues_a_silent_job_and_forgets_delivered_text_once_ended(
        self, customer, serving_host, catalog, settings
    ) -> None:
        settings.STALL_SECONDS = 20
        settings.OUTPUT_RETENTION_SECONDS = 0
        request, job = claimed(customer, serving_host, catalog)
        services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text="half an ans")
        Job.objects.filter(pk=job.pk).update(last_token_at=timezone.now() - timedelta(seconds=21))
        assert services.watchdog_tick() == 1
        assert list(request.jobs.order_by("attempt").values_list("status", flat=True)) == ["failed", "queued"]
        request.refresh_from_db()
        assert request.status == "running" and request.resumed
        Job.objects.filter(request=request, status="queued").update(created_at=timezone.now() - timedelta(hours=1))
        assert services.watchdog_tick() >= 2
        request.refresh_from_db()
        assert (request.status, request.error_code, request.delivered_text, request.output_forgotten) == (
            "failed",
            "host_failed",
            "",
            True,
        )
        assert ledger.customer_account(user=customer.user).held_ucents == 0
