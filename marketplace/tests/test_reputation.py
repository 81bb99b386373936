"""Reputation and the limits no host can exceed: probation and trust, claim caps, routing by
measured speed, trusted-only requests, vesting and forfeits, the text bound, the deadline,
finish_reason as the text supports it, embeddings of the model's width."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from django.utils import timezone

from billing import selectors as ledger
from billing import services as billing
from billing.errors import PayoutRefused
from billing.models import LedgerTransaction, PayoutProfile
from catalog.models import CatalogModel
from conftest import make_customer
from core.errors import ApiError
from hosts.models import Host
from marketplace import services
from marketplace.hostdoor import claim_slots, claiming
from marketplace.hostdoor.claim_slots import WAITING, WaitingClaims
from marketplace.lifecycle import canaries
from marketplace.models import CanaryCheck, CanaryReference, Job, Request
from marketplace.openai import admission
from marketplace.tests.test_services import submit
from marketplace.trust import reputation, routing
from testkit.evidence import drawn
from testkit.requests import CHAT, submit_request

pytestmark = pytest.mark.django_db


def online(serving, *, slots: int = 1, trusted: bool = False, measured: float | None = None) -> Host:
    Host.objects.filter(pk=serving.host.pk).update(
        last_heartbeat_at=timezone.now(),
        slots=slots,
        trusted_at=timezone.now() if trusted else None,
        measured_tps=measured,
    )
    serving.host.refresh_from_db()
    return serving.host


def claim(serving) -> Job | None:
    return services.job_claim_next(host=serving.host, fingerprint=serving.fingerprint)


class ClaimCapTests:
    def test_a_host_runs_at_most_its_slots(self, customer, serving_host, catalog) -> None:
        online(serving_host, slots=2)
        for _ in range(3):
            submit(customer, catalog)
        assert claim(serving_host) is not None and claim(serving_host) is not None
        assert claim(serving_host) is None, "a third job at once is over its 2 slots"
        assert Job.objects.filter(status=Job.Status.QUEUED).count() == 1

    def test_probation_bounds_a_host_below_its_slots_and_trust_lifts_it(
        self, customer, serving_host, catalog, settings
    ) -> None:
        settings.HOST_PROBATION_MAX_JOBS = 1
        online(serving_host, slots=3)
        for _ in range(3):
            submit(customer, catalog)
        assert claim(serving_host) is not None
        assert claim(serving_host) is None, "in probation: one job at a time"
        online(serving_host, slots=3, trusted=True)
        assert claim(serving_host) is not None and claim(serving_host) is not None

    def test_a_banned_host_claims_nothing(self, customer, serving_host, catalog) -> None:
        online(serving_host)
        Host.objects.filter(pk=serving_host.host.pk).update(banned_at=timezone.now(), ban_reason="junk", banned_by="op")
        submit(customer, catalog)
        assert claim(serving_host) is None

    @pytest.mark.django_db(transaction=True)  # the long-polls read through the database threads
    def test_long_polls_beyond_the_cap_are_refused_with_a_clear_error(self, serving_host, catalog, settings) -> None:
        settings.HOST_PROBATION_MAX_JOBS = 2
        host = online(serving_host, slots=8)

        async def polls() -> list:
            waiting = [
                asyncio.ensure_future(claiming.claim_when_offered(host, fingerprint=serving_host.fingerprint, wait=1.0))
                for _ in range(2)
            ]
            await asyncio.sleep(0.3)
            try:
                await claiming.claim_when_offered(host, fingerprint=serving_host.fingerprint, wait=0.1)
            except ApiError as refusal:
                third = refusal
            return [await asyncio.gather(*waiting), third]

        answers, third = asyncio.run(polls())
        assert answers == [None, None]
        assert third.status == 429 and third.code == "too_many_claims" and "at most 2 jobs" in third.message
        assert asyncio.run(WAITING.held(host.pk)) == 0, "a finished long-poll gives its place back"

    @pytest.mark.django_db(transaction=True)
    def test_the_cap_holds_across_gateway_processes_and_a_dead_processs_polls_lapse(
        self, serving_host, catalog, settings
    ) -> None:
        """Several gateway processes share Redis: another process's waiting long-polls count
        (a fresh `WaitingClaims` is another process's count), and those of a process that
        died lapse with their wait."""
        if not settings.REDIS_URL:
            pytest.skip("one gateway process on the embedded default: its own count is everyone's")
        settings.HOST_PROBATION_MAX_JOBS = 2
        host = online(serving_host, slots=8)
        elsewhere = WaitingClaims()

        async def scenario() -> tuple:
            tickets = [await elsewhere.enter(host.pk, cap=2, wait=20) for _ in range(2)]
            try:
                await claiming.claim_when_offered(host, fingerprint=serving_host.fingerprint, wait=0.1)
            except ApiError as refusal:
                refused = refusal
            await elsewhere.leave(host.pk, tickets[0])
            here = await claiming.claim_when_offered(host, fingerprint=serving_host.fingerprint, wait=0.1)
            dead = await elsewhere.enter(host.pk, cap=2, wait=-claim_slots.MARGIN_S)  # its process died long ago
            held = await WAITING.held(host.pk)
            await elsewhere.leave(host.pk, tickets[1])
            return refused, here, bool(dead), held

        refused, here, dead_entered, held = asyncio.run(scenario())
        assert refused.status == 429 and refused.code == "too_many_claims"
        assert here is None, "a place came free: the long-poll waited and found nothing"
        assert dead_entered and held == 1, "a lapsed entry is not counted"
        assert asyncio.run(WAITING.held(host.pk)) == 0


class TrustedOnlyTests:
    def test_a_request_for_trusted_hosts_only_waits_for_one(self, customer, serving_host, outsider, catalog) -> None:
        online(serving_host)
        online(outsider, trusted=True)
        request = submit_request(customer, catalog, messages=CHAT, max_tokens=8, prompt_tokens=5, trusted_only=True)
        job = request.jobs.get()
        assert job.trusted_only and job.offered_host_id == outsider.host.pk
        Job.objects.filter(pk=job.pk).update(offer_until=timezone.now() - timedelta(seconds=1))  # the offer lapsed
        assert claim(serving_host) is None, "a host in probation never takes it"
        assert claim(outsider).request_id == request.pk

    def test_the_key_setting_and_the_provider_object_both_ask_for_it(self, customer) -> None:
        assert not admission.trusted_only(api_key=customer.key, data={})
        assert admission.trusted_only(api_key=customer.key, data={"provider": {"trusted_only": True}})
        customer.key.trusted_only = True
        assert admission.trusted_only(api_key=customer.key, data={"provider": None})

    @pytest.mark.django_db(transaction=True)  # the key is looked up first, on the views' database threads
    def test_the_api_refuses_an_unknown_provider_preference(self, client, customer, catalog) -> None:
        body = {"model": catalog.name, "messages": CHAT, "provider": {"order": ["x"]}}
        response = client.post(
            "/v1/chat/completions",
            body,
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {customer.secret}",
        )
        assert response.status_code == 400
        assert "unsupported provider preference 'order'" in response.json()["error"]["message"]


class RoutingByReputationTests:
    def test_trusted_hosts_are_offered_work_before_hosts_in_probation(
        self, customer, serving_host, outsider, catalog
    ) -> None:
        online(serving_host, slots=4)
        online(outsider, slots=4, trusted=True)
        offered = {submit(customer, catalog).jobs.get().offered_host_id for _ in range(3)}
        assert offered == {outsider.host.pk}

    def test_routing_weighs_measured_speed_and_ignores_an_overstated_report(
        self, serving_host, outsider, catalog
    ) -> None:
        online(serving_host, measured=10.0)  # reported 40 tokens/s: over twice what it delivers
        online(outsider, measured=30.0)
        pool = {c.host_id: c for c in routing.candidates(model=catalog, now=timezone.now())}
        assert pool[serving_host.host.pk].weight == 10.0 and pool[serving_host.host.pk].overstated
        assert pool[outsider.host.pk].weight == 30.0 and not pool[outsider.host.pk].overstated

    def test_an_unmeasured_report_counts_only_up_to_a_bound(self, serving_host, catalog, settings) -> None:
        settings.ROUTING_UNMEASURED_MAX_TPS = 25.0
        online(serving_host)
        serving_host.host.qualifications.update(gen_tps=1e300)
        [candidate] = routing.candidates(model=catalog, now=timezone.now())
        assert candidate.weight == 25.0

    def test_a_completed_job_measures_the_host(self, customer, serving_host, catalog) -> None:
        from catalog.tokenizer import tokenizer_for

        tokenizer_for(catalog.tokenizer).count("warm", special=False)  # its first load is not the host's time
        submit(customer, catalog, max_tokens=40)
        job = claim(serving_host)
        services.job_push_tokens(
            host=serving_host.host, job_id=job.pk, seq=0, text=" one two three four five six seven eight nine ten"
        )
        Job.objects.filter(pk=job.pk).update(first_token_at=timezone.now() - timedelta(seconds=1))
        services.job_complete(host=serving_host.host, job_id=job.pk, finish_reason="stop", token_ids=drawn(job.pk))
        measured = Host.objects.get(pk=serving_host.host.pk).measured_tps
        assert measured is not None and 5 < measured < 15, measured


class TrustTests:
    def _passed_canaries(self, host: Host, catalog: CatalogModel, n: int) -> None:
        reference = CanaryReference.objects.create(
            model=catalog, kind="completion", prompt="p", max_tokens=4, text="x", tokens=1, exact_chars=1
        )
        for _ in range(n):
            request = submit(make_customer(), catalog)
            CanaryCheck.objects.create(
                host=host, reference=reference, request=request, verdict=CanaryCheck.Verdict.PASSED
            )

    def test_a_host_leaves_probation_after_canaries_jobs_and_time(
        self, customer, serving_host, catalog, settings
    ) -> None:
        settings.CANARY_TRUST_AFTER, settings.TRUST_AFTER_JOBS, settings.TRUST_AFTER_SECONDS = 2, 1, 3600
        host = online(serving_host)
        self._passed_canaries(host, catalog, 2)
        submit(customer, catalog)
        job = claim(serving_host)
        services.job_push_tokens(host=host, job_id=job.pk, seq=0, text="Hello")
        services.job_complete(host=host, job_id=job.pk, finish_reason="stop", token_ids=drawn(job.pk))
        assert Host.objects.get(pk=host.pk).trusted_at is None, "an hour has not passed"
        Host.objects.filter(pk=host.pk).update(created_at=timezone.now() - timedelta(hours=2))
        assert reputation.trust_review(host_id=host.pk)
        assert reputation.reputation_of(Host.objects.get(pk=host.pk)).status == "trusted"

    def test_a_failed_canary_revokes_trust_and_forfeits_what_has_not_vested(
        self, customer, serving_host, catalog
    ) -> None:
        host = online(serving_host, trusted=True)
        submit(customer, catalog)
        job = claim(serving_host)
        services.job_push_tokens(host=host, job_id=job.pk, seq=0, text=" Hello there")
        earned = services.job_complete(
            host=host, job_id=job.pk, finish_reason="stop", token_ids=drawn(job.pk)
        ).earned_ucents
        assert earned > 0
        reference = CanaryReference.objects.create(
            model=catalog,
            kind="completion",
            prompt="Once upon",
            max_tokens=8,
            text=" a time there was a",
            tokens=5,
            exact_chars=19,
        )
        check = CanaryCheck.objects.create(host=host, reference=reference, request=submit(make_customer(), catalog))
        assert (
            canaries.canary_judge(check=check, host=host, text="junk junk junk", completion_tokens=3, audited=False)
            == CanaryCheck.Verdict.FAILED
        )
        host.refresh_from_db()
        assert host.trusted_at is None and host.maintenance_by == "verification"
        forfeit = LedgerTransaction.objects.get(kind=LedgerTransaction.Kind.FORFEIT)
        assert forfeit.memo.startswith("Failed verification") and ledger.host_account(host=host).balance_ucents == 0
        assert ledger.host_payouts(host=host).forfeited_ucents == earned
        assert ledger.reconcile_report() == []


class VestingTests:
    def test_earnings_are_payable_only_after_the_holding_period(self, serving_host, catalog, settings) -> None:
        settings.PAYOUT_MINIMUM_UCENTS = 1_000_000
        host = serving_host.host
        PayoutProfile.objects.create(host=host, stripe_account_id="acct_test")
        customer = make_customer(credit_ucents=10**11)
        request = submit(customer, catalog)
        billing.hold_settle(
            hold=request.hold, cost_ucents=request.hold.amount_ucents, host=host, reference=request.public_id
        )
        money = ledger.host_payouts(host=host)
        assert money.available_ucents == 0 and money.unvested_ucents == money.balance_ucents > 0
        with pytest.raises(PayoutRefused, match="vests within 7 days"):
            billing.payout_request(host=host, amount_ucents=1_000_000)
        LedgerTransaction.objects.filter(kind=LedgerTransaction.Kind.SETTLEMENT).update(
            created_at=timezone.now() - timedelta(days=8)
        )
        money = ledger.host_payouts(host=host)
        assert money.unvested_ucents == 0 and money.available_ucents == money.balance_ucents
        assert billing.earnings_forfeit(host=host, reason="late") == 0, "vested earnings are never forfeited"


class TextBoundTests:
    def test_a_host_sending_more_than_max_tokens_allows_is_fenced(self, customer, serving_host, catalog) -> None:
        request = submit(customer, catalog, max_tokens=2)
        job = claim(serving_host)
        assert job.max_chars == 2 * 31  # Gemma's longest token decodes to 31 characters
        host = serving_host.host
        services.job_push_tokens(host=host, job_id=job.pk, seq=0, text="a" * 60)
        with pytest.raises(services.TextBoundExceeded):
            services.job_push_tokens(host=host, job_id=job.pk, seq=1, text="b" * 10)
        job.refresh_from_db()
        request.refresh_from_db()
        assert job.status == Job.Status.FAILED and "more text than max_tokens" in job.fail_reason
        assert request.delivered_text == "a" * 60
        assert request.status == Request.Status.COMPLETED and request.finish_reason == "length", (
            "its budget was delivered"
        )

    def test_completing_with_far_more_tokens_than_asked_settles_max_tokens_cut_there(
        self, customer, serving_host, catalog
    ) -> None:
        """An answer counting past max_tokens and the slack (an honest host's tokens can spell
        twice as many when counted again) settles as "length", billed max_tokens; the customer
        got it cut at the limit (`streaming`), and the host is paid for max_tokens, no more."""
        request = submit(customer, catalog, max_tokens=4)
        job = claim(serving_host)
        services.job_push_tokens(
            host=serving_host.host, job_id=job.pk, seq=0, text=" one two three four five six seven eight"
        )
        done = services.job_complete(
            host=serving_host.host, job_id=job.pk, finish_reason="length", token_ids=drawn(job.pk, ended=False)
        )
        job.refresh_from_db()
        request.refresh_from_db()
        assert (request.status, request.finish_reason, request.completion_tokens) == (
            Request.Status.COMPLETED,
            "length",
            4,
        )
        assert (
            request.cost_ucents == request.prompt_tokens * catalog.input_price_ucents + 4 * catalog.output_price_ucents
        )
        assert (
            job.status == Job.Status.COMPLETED
            and done.earned_ucents == job.earned_ucents == request.cost_ucents * 80 // 100
        )

    def test_every_job_has_a_deadline_the_watchdog_keeps(self, customer, serving_host, catalog, settings) -> None:
        request = submit(customer, catalog, max_tokens=20)
        job = request.jobs.get()
        allowed = (
            settings.QUEUE_TIMEOUT_SECONDS
            + settings.JOB_START_ALLOWANCE_SECONDS
            + 20 / settings.JOB_MIN_TOKENS_PER_SECOND
        )
        assert abs((job.deadline_at - job.created_at).total_seconds() - allowed) < 1
        claim(serving_host)
        services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text=" a")  # trickling: not stalled
        Job.objects.filter(pk=job.pk).update(deadline_at=timezone.now() - timedelta(seconds=1))
        assert services.overdue_job_end_one()
        job.refresh_from_db()
        assert job.status == Job.Status.FAILED and "deadline" in job.fail_reason


class FinishReasonTests:
    @pytest.mark.parametrize(
        ("claimed", "tokens", "expected"),
        [
            ("stop", 20, "length"),  # the budget was used: whatever the host says
            ("length", 5, "stop"),  # "length" far short of it is not true
            ("length", 19, "length"),  # counted again, an honest answer may come out a token short
            ("stop", 5, "stop"),
        ],
    )
    def test_finish_reason_is_what_the_text_supports(self, claimed, tokens, expected) -> None:
        assert services.finish_reason_checked(claimed=claimed, completion_tokens=tokens, max_tokens=20) == expected


class EmbeddingWidthTests:
    def test_vectors_must_have_the_models_width(self, customer) -> None:
        model = CatalogModel.objects.get(name="all-minilm-l6-v2")
        assert model.embedding_dimensions == 384
        request = Request(model=model, inputs=["a"])
        with pytest.raises(services.BadResult, match="model's width is 384"):
            services.embeddings_checked(request=request, vectors=[[0.5] * 383])
        assert len(services.embeddings_checked(request=request, vectors=[[0.5] * 384])[0]) == 384


class StopSequenceTests:
    def test_the_gateway_ends_the_answer_at_a_stop_sequence_the_host_ignored(
        self, customer, serving_host, catalog
    ) -> None:
        request = submit_request(
            customer, catalog, messages=CHAT, stream=True, max_tokens=40, stop=["END"], prompt_tokens=5
        )
        job = claim(serving_host)
        services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text=" one two E")
        services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=1, text="ND three four five")
        done = services.job_complete(
            host=serving_host.host, job_id=job.pk, finish_reason="length", token_ids=drawn(job.pk, ended=False)
        )
        assert done.request.finish_reason == "stop"
        assert done.request.completion_tokens == services.count_output(request, " one two ")

    def test_a_stream_never_relays_a_stop_sequence_split_across_batches(self) -> None:
        from marketplace.openai.streaming import Ended, RequestListener, Text

        listener = RequestListener("chatcmpl-x")
        listener.stops = ["STOP", "\n\n"]
        batches = ["Hello S", "T", "OP and more", " after"]

        async def arrivals():
            for text in batches:
                yield Text(text)
            yield Ended(Request(public_id="chatcmpl-x"))

        listener._arrivals = arrivals

        async def relayed() -> list:
            return [event.text if isinstance(event, Text) else "<end>" async for event in listener.events()]

        out = asyncio.run(relayed())
        assert "".join(out[:-1]) == "Hello " and out[-1] == "<end>"
        assert listener.sent == len("Hello ")
        listener.stops, batches[:] = [], ["a", "b"]
        listener.sent = 0
        assert asyncio.run(relayed()) == ["a", "b", "<end>"], "without stop sequences nothing is held back"


class BanTests:
    def test_a_ban_ends_running_jobs_and_forfeits_unvested_earnings(self, customer, serving_host, catalog) -> None:
        host = online(serving_host, slots=2)
        submit(customer, catalog)
        done = claim(serving_host)
        services.job_push_tokens(host=host, job_id=done.pk, seq=0, text=" earned")
        earned = services.job_complete(
            host=host, job_id=done.pk, finish_reason="stop", token_ids=drawn(done.pk)
        ).earned_ucents
        request = submit(customer, catalog)
        running = claim(serving_host)
        assert services.host_ban_with_consequences(host=host, reason="junk answers", by="op")
        running.refresh_from_db()
        assert running.status == Job.Status.FAILED and running.fail_reason == "its host was banned"
        assert request.jobs.filter(status=Job.Status.QUEUED).exists(), "the request waits for another host"
        forfeit = LedgerTransaction.objects.get(kind=LedgerTransaction.Kind.FORFEIT)
        assert forfeit.memo == "Banned by op: junk answers"
        assert ledger.host_payouts(host=host).forfeited_ucents == earned
        assert not services.host_ban_with_consequences(host=host, reason="again", by="op"), "banned once"
