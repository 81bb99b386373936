"""A Hypothesis state machine over the real services: money moves in every order
the rules allow, and after every step the ledger's invariants hold."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

import pytest
from django.db import transaction
from django.db.models import Count, Sum
from django.test import Client
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from billing import selectors, services
from billing.errors import BillingError
from billing.models import Account, Hold, LedgerEntry, LedgerTransaction, Payout, PayoutProfile
from billing.stripe_local import checkout_completed_event, sign
from billing.tests.conftest import BACK, WEBHOOK_SECRET
from catalog.models import CatalogModel
from conftest import make_customer, make_host
from marketplace import services as market
from marketplace.models import Job, Request
from testkit.evidence import drawn
from testkit.requests import submit_request

if TYPE_CHECKING:
    from hypothesis.strategies import DataObject

    from hosts.models import Host

pytestmark = pytest.mark.django_db

WORDS = st.text(alphabet="abc xyz", min_size=0, max_size=12)


class _Rollback(Exception):
    pass


class LedgerMachine(RuleBasedStateMachine):
    """Each example runs inside a transaction that is rolled back at teardown."""

    fake = None  # set by the test

    def __init__(self) -> None:
        super().__init__()
        self._atomic = transaction.atomic()
        self._atomic.__enter__()
        self.client = Client()
        self.events: list[str] = []

    @initialize()
    def setup(self) -> None:
        self.model = CatalogModel.objects.create(
            name=f"m-{uuid.uuid4().hex[:6]}",
            context_length=4096,
            input_price_ucents=10_000,
            output_price_ucents=200_000,
            tokenizer="bytes",
        )
        self.customer = make_customer(credit_ucents=0)
        self.hosts = []
        for account_id in ("acct_good", "acct_other"):
            serving = make_host(qualified=False)
            from hosts.services import qualification_register

            qualification_register(
                host=serving.host,
                model_name=self.model.name,
                fingerprint=serving.fingerprint,
                benchmark={"prompt_tps": 1, "gen_tps": 1, "ttft_ms": 1, "memory_mb": 1},
                machine={},
            )
            PayoutProfile.objects.create(host=serving.host, stripe_account_id=account_id)
            self.hosts.append(serving)
        self.top_up(cents=5_000)

    def teardown(self) -> None:
        transaction.set_rollback(True)
        self._atomic.__exit__(_Rollback, _Rollback(), None)

    # --- money in ---------------------------------------------------------------------------

    @rule(cents=st.integers(min_value=500, max_value=5_000))
    def top_up(self, cents: int) -> None:
        topup = services.topup_create(user=self.customer.user, amount_cents=cents, **BACK)
        payload = checkout_completed_event(self.fake.sessions[topup.stripe_session_id])
        self.events.append(payload)
        self._deliver(payload)

    @precondition(lambda self: self.events)
    @rule(data=st.data())
    def replay_webhook(self, data: DataObject) -> None:
        before = selectors.ledger_total(), LedgerTransaction.objects.count()
        self._deliver(data.draw(st.sampled_from(self.events)))
        assert (selectors.ledger_total(), LedgerTransaction.objects.count()) == before

    def _deliver(self, payload: str) -> None:
        response = self.client.post(
            "/billing/stripe/webhook/",
            data=payload.encode(),
            content_type="application/json",
            HTTP_STRIPE_SIGNATURE=sign(payload, WEBHOOK_SECRET),
        )
        assert response.status_code == 200, response.content

    # --- the request path ------------------------------------------------------------------

    @rule(
        max_tokens=st.integers(min_value=1, max_value=3_000),
        prompt_tokens=st.integers(min_value=1, max_value=50),
        claim_by=st.sampled_from([None, 0, 1]),
    )
    def admit(self, max_tokens: int, prompt_tokens: int, claim_by: int | None) -> None:
        try:
            submit_request(self.customer, self.model, stream=True, max_tokens=max_tokens, prompt_tokens=prompt_tokens)
        except BillingError:
            return
        if claim_by is not None:
            self.claim(claim_by)

    @rule(host=st.integers(0, 1))
    def claim(self, host: int) -> None:
        serving = self.hosts[host]
        market.job_claim_next(host=serving.host, fingerprint=serving.fingerprint)

    def _running(self) -> list[Job]:
        return list(Job.objects.filter(status=Job.Status.RUNNING, model=self.model).order_by("pk"))

    def _host_of(self, job: Job) -> Host:
        return next(s.host for s in self.hosts if s.host.pk == job.host_id)

    @precondition(lambda self: self._running())
    @rule(data=st.data(), text=WORDS)
    def push_tokens(self, data: DataObject, text: str) -> None:
        job = data.draw(st.sampled_from(self._running()))
        market.job_push_tokens(host=self._host_of(job), job_id=job.pk, seq=job.next_seq, text=text)

    @precondition(lambda self: self._running())
    @rule(data=st.data(), twice=st.booleans())
    def settle(self, data: DataObject, twice: bool) -> None:
        job = data.draw(st.sampled_from(self._running()))
        first = market.job_complete(
            host=self._host_of(job), job_id=job.pk, finish_reason="stop", token_ids=drawn(job.pk)
        )
        if twice:  # a lost answer, retried: same result, nothing posted again
            again = market.job_complete(
                host=self._host_of(job), job_id=job.pk, finish_reason="stop", token_ids=drawn(job.pk)
            )
            assert again.earned_ucents == first.earned_ucents

    @precondition(lambda self: self._running())
    @rule(data=st.data())
    def fail(self, data: DataObject) -> None:
        job = data.draw(st.sampled_from(self._running()))
        market.job_fail(host=self._host_of(job), job_id=job.pk, reason="oom")

    @rule()
    def expire_hold(self) -> None:
        queued = Job.objects.filter(status=Job.Status.QUEUED, model=self.model).order_by("pk").first()
        if queued is not None:
            assert market.request_expire_unclaimed(request_id=queued.request_id)
        services.orphaned_hold_release_one()

    # --- money out ---------------------------------------------------------------------------

    @rule(host=st.integers(0, 1), whole=st.booleans())
    def request_payout(self, host: int, whole: bool) -> None:
        try:
            services.payout_request(host=self.hosts[host].host, amount_ucents=None if whole else 1_000_000)
        except BillingError:
            pass

    @precondition(lambda self: Payout.objects.filter(status=Payout.Status.REQUESTED).exists())
    @rule(refuse=st.booleans())
    def pay_or_fail_payout(self, refuse: bool) -> None:
        payout = Payout.objects.filter(status=Payout.Status.REQUESTED).order_by("pk").first()
        self.fake.refuse_transfers = refuse
        decided = services.payout_approve(payout_id=payout.pk)
        assert decided.status == (Payout.Status.FAILED if refuse else Payout.Status.PAID)

    # --- invariants ----------------------------------------------------------------------------

    @invariant()
    def every_transaction_sums_to_zero(self) -> None:
        assert selectors.unbalanced_transactions() == []
        assert selectors.ledger_total() == 0

    @invariant()
    def no_available_balance_below_zero(self) -> None:
        for account in Account.objects.exclude(kind=Account.Kind.FUNDING):
            assert account.available_ucents >= 0, account

    @invariant()
    def caches_and_books_reconcile(self) -> None:
        assert selectors.reconcile_report() == []

    @invariant()
    def a_host_earns_at_most_80_percent_of_the_debit(self) -> None:
        for txn in LedgerTransaction.objects.filter(kind=LedgerTransaction.Kind.SETTLEMENT):
            entries = LedgerEntry.objects.filter(transaction=txn).select_related("account")
            legs = {e.account.kind: e.amount_ucents for e in entries}
            debit = -legs.get("customer", 0)
            assert debit >= 0 and 100 * legs.get("host", 0) <= 80 * debit

    @invariant()
    def each_request_is_settled_at_most_once(self) -> None:
        counts = LedgerTransaction.objects.filter(kind="settlement").values("reference").annotate(n=Count("pk"))
        assert all(row["n"] == 1 for row in counts)
        settled = set(Request.objects.filter(status="completed").values_list("public_id", flat=True))
        assert settled == set(LedgerTransaction.objects.filter(kind="settlement").values_list("reference", flat=True))
        assert not Hold.objects.filter(status="active", request__status__in=["completed", "failed"]).exists()
        spent = Request.objects.filter(user=self.customer.user).aggregate(total=Sum("cost_ucents"))["total"] or 0
        self.customer.key.refresh_from_db()
        assert self.customer.key.spent_ucents == spent


class LedgerMachineTests:
    def test_it_keeps_the_books_straight_in_any_order(self, catalog, fake_stripe, settings) -> None:
        settings.PAYOUT_MINIMUM_UCENTS = 1_000_000  # one cent, so hosts can withdraw within a few steps
        LedgerMachine.fake = fake_stripe
        run_state_machine_as_test(
            LedgerMachine,
            settings=hypothesis_settings(
                max_examples=20,
                stateful_step_count=40,
                deadline=None,
                database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
            ),
        )
