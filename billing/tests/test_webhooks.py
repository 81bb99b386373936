from __future__ import annotations

import json
import random
import time
from typing import TYPE_CHECKING

import pytest
from django.test import Client

from billing import ledger, selectors, services
from billing.models import Account, LedgerTransaction, PayoutProfile, StripeEvent, TopUp
from billing.stripe_local import charge_refunded_event, checkout_completed_event, dispute_event, event_body, sign
from billing.tests.conftest import BACK, WEBHOOK_SECRET
from conftest import make_customer, make_host

if TYPE_CHECKING:
    from django.contrib.auth.models import User
    from django.test.client import _MonkeyPatchedWSGIResponse as TestResponse

    from billing.stripe_local import LocalStripe

pytestmark = pytest.mark.django_db

URL = "/billing/stripe/webhook/"


def deliver(payload: str, signature: str | None = None) -> TestResponse:
    header = sign(payload, WEBHOOK_SECRET) if signature is None else signature
    return Client().post(URL, data=payload.encode(), content_type="application/json", HTTP_STRIPE_SIGNATURE=header)


def open_topup(fake_stripe: LocalStripe, user: User, cents: int) -> tuple[TopUp, dict]:
    topup = services.topup_create(user=user, amount_cents=cents, **BACK)
    return topup, fake_stripe.sessions[topup.stripe_session_id]


def balance(user: User) -> int:
    account = selectors.customer_account(user=user)
    return account.balance_ucents if account else 0


class WebhookCreditTests:
    def test_it_credits_every_event_once_when_each_is_delivered_three_times_shuffled(
        self, catalog, fake_stripe
    ) -> None:
        alice, bob = make_customer(credit_ucents=0), make_customer(credit_ucents=0)
        events = []
        for user, cents in [(alice.user, 1_000), (alice.user, 2_500), (bob.user, 50_000), (bob.user, 777)]:
            _, session = open_topup(fake_stripe, user, cents)
            events.append(checkout_completed_event(session))
        deliveries = events * 3
        random.Random(7).shuffle(deliveries)
        for payload in deliveries:
            assert deliver(payload).status_code == 200
        assert balance(alice.user) == 3_500 * 1_000_000
        assert balance(bob.user) == 50_777 * 1_000_000
        assert LedgerTransaction.objects.filter(kind="topup").count() == 4
        assert StripeEvent.objects.count() == 4
        assert services.system_account(Account.Kind.FUNDING).balance_ucents == -(3_500 + 50_777) * 1_000_000
        assert selectors.reconcile_report() == []

    def test_it_credits_a_session_once_even_from_two_different_events(self, catalog, fake_stripe) -> None:
        customer = make_customer(credit_ucents=0)
        _, session = open_topup(fake_stripe, customer.user, 1_000)
        assert deliver(checkout_completed_event(session)).json()["outcome"] == "credited"
        late = checkout_completed_event(session, event_type="checkout.session.async_payment_succeeded")
        assert deliver(late).json()["outcome"] == "ignored"
        assert balance(customer.user) == 1_000_000_000

    def test_it_credits_nothing_for_an_unpaid_session(self, catalog, fake_stripe) -> None:
        customer = make_customer(credit_ucents=0)
        topup, session = open_topup(fake_stripe, customer.user, 1_000)
        assert deliver(checkout_completed_event(session, payment_status="unpaid")).json()["outcome"] == "ignored"
        topup.refresh_from_db()
        assert topup.status == TopUp.Status.OPEN and balance(customer.user) == 0

    def test_it_rejects_an_amount_that_differs_from_the_session_we_created(self, catalog, fake_stripe) -> None:
        customer = make_customer(credit_ucents=0)
        _, session = open_topup(fake_stripe, customer.user, 1_000)
        response = deliver(checkout_completed_event(session, amount_total=100_000))
        assert response.status_code == 200 and response.json()["outcome"] == "rejected"
        assert balance(customer.user) == 0

    def test_it_rejects_a_session_we_never_created(self, catalog, fake_stripe) -> None:
        session = {
            "id": "cs_test_stranger",
            "object": "checkout.session",
            "amount_total": 1_000,
            "currency": "usd",
            "client_reference_id": "1",
            "metadata": {},
        }
        assert deliver(checkout_completed_event(session)).json()["outcome"] == "rejected"
        assert LedgerTransaction.objects.filter(kind="topup").count() == 0


class WebhookSignatureTests:
    def test_it_rejects_200_forged_or_stale_deliveries(self, catalog, fake_stripe) -> None:
        customer = make_customer(credit_ucents=0)
        _, session = open_topup(fake_stripe, customer.user, 5_000)
        payload = checkout_completed_event(session)
        now = int(time.time())
        forgeries = [
            lambda p: (p, sign(p, "whsec_wrong")),  # wrong secret
            lambda p: (p, sign(p, WEBHOOK_SECRET, timestamp=now - 301)),  # stale
            lambda p: (p, sign(p, WEBHOOK_SECRET, timestamp=now - 3_600)),  # very stale
            lambda p: (json.dumps(json.loads(p)), sign(p, WEBHOOK_SECRET)),  # re-serialised body
            lambda p: (p.replace('"amount_total": 5000', '"amount_total": 50000'), sign(p, WEBHOOK_SECRET)),  # tampered
            lambda p: (p, ""),  # no signature
            lambda p: (p, "t=abc,v1=zz"),  # garbage header
            lambda p: (p, sign(p, WEBHOOK_SECRET).replace("v1=", "v0=")),  # wrong scheme
        ]
        for index in range(200):
            body, header = forgeries[index % len(forgeries)](payload)
            response = deliver(body, header)
            assert response.status_code == 400, (index, response.content)
            assert response.json()["error"]["code"] == "invalid_webhook"
        assert StripeEvent.objects.count() == 0 and balance(customer.user) == 0
        assert deliver(payload).status_code == 200 and balance(customer.user) == 5_000_000_000

    def test_it_rejects_deliveries_when_stripe_is_not_configured(self, catalog, no_stripe) -> None:
        payload = checkout_completed_event({"id": "cs_x", "amount_total": 1, "currency": "usd"})
        assert deliver(payload, sign(payload, "")).status_code == 400


class MoneyBackOutTests:
    """Refunds and chargebacks after the credit was spent take it back through the ledger
    (issue 17): the balance may go negative, admission refuses until it is covered."""

    def paid(self, fake_stripe, cents: int = 1_000):  # noqa: ANN001, ANN201
        customer = make_customer(credit_ucents=0)
        topup, session = open_topup(fake_stripe, customer.user, cents)
        assert deliver(checkout_completed_event(session)).json()["outcome"] == "credited"
        return customer, topup, session

    def test_a_refund_after_spending_debits_the_customer_into_debt_once(self, catalog, fake_stripe) -> None:
        customer, topup, session = self.paid(fake_stripe)
        spent = 800_000_000  # $8 of the $10 spent: the refund comes after
        ledger.ledger_post(
            kind=LedgerTransaction.Kind.GRANT,
            reference="test-spend",
            memo="spent",
            legs=[
                (services.account_for_customer(user=customer.user), -spent),
                (services.system_account(Account.Kind.PLATFORM), spent),
            ],
        )
        partial = charge_refunded_event(session, amount_refunded=400)
        assert deliver(partial).json()["outcome"] == "debited"
        assert deliver(partial).json()["outcome"] == "debited", "a replay of the same event gets the same answer, once"
        assert balance(customer.user) == 1_000_000_000 - spent - 400_000_000
        assert deliver(charge_refunded_event(session, amount_refunded=1_000)).json()["outcome"] == "debited"
        assert deliver(charge_refunded_event(session, amount_refunded=1_000)).json()["outcome"] == "ignored"
        assert balance(customer.user) == 1_000_000_000 - spent - 1_000_000_000 < 0
        topup.refresh_from_db()
        assert topup.refunded_cents == 1_000
        assert LedgerTransaction.objects.filter(kind="refund").count() == 2
        assert selectors.reconcile_report() == []

    @pytest.mark.django_db(transaction=True)  # the API is an async view: its database threads must see the rows
    def test_a_customer_in_debt_gets_402_until_it_is_covered(self, catalog, fake_stripe) -> None:
        customer, _, session = self.paid(fake_stripe)
        deliver(charge_refunded_event(session, amount_refunded=1_000))
        response = Client().post(
            "/v1/chat/completions",
            data=json.dumps(
                {"model": "gemma-3-270m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
            ),
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {customer.secret}",
        )
        assert response.status_code == 402 and response.json()["error"]["code"] == "insufficient_credit"

    def test_a_dispute_takes_the_credit_back_and_a_won_dispute_gives_it_back(self, catalog, fake_stripe) -> None:
        customer, topup, session = self.paid(fake_stripe)
        assert deliver(dispute_event(session, amount=1_000)).json()["outcome"] == "debited"
        assert deliver(dispute_event(session, amount=1_000)).json()["outcome"] == "ignored", "one dispute, taken once"
        assert balance(customer.user) == 0
        assert deliver(charge_refunded_event(session, amount_refunded=1_000)).json()["outcome"] == "ignored", (
            "nothing left"
        )
        assert deliver(dispute_event(session, amount=1_000, closed="won")).json()["outcome"] == "restored"
        assert deliver(dispute_event(session, amount=1_000, closed="won")).json()["outcome"] == "ignored"
        assert balance(customer.user) == 1_000_000_000
        topup.refresh_from_db()
        assert topup.disputed_cents == 0
        assert selectors.reconcile_report() == []

    def test_a_lost_dispute_keeps_the_credit_taken(self, catalog, fake_stripe) -> None:
        customer, _, session = self.paid(fake_stripe)
        deliver(dispute_event(session, amount=600, dispute_id="dp_lost"))
        assert (
            deliver(dispute_event(session, amount=600, closed="lost", dispute_id="dp_lost")).json()["outcome"]
            == "ignored"
        )
        assert balance(customer.user) == 400_000_000
        assert selectors.reconcile_report() == []

    def test_a_refund_of_a_payment_we_never_credited_is_rejected(self, catalog, fake_stripe) -> None:
        customer = make_customer(credit_ucents=0)
        _, session = open_topup(fake_stripe, customer.user, 1_000)  # never paid
        assert deliver(charge_refunded_event(session, amount_refunded=1_000)).json()["outcome"] == "rejected"
        assert balance(customer.user) == 0

    def test_a_session_we_never_stored_is_reconciled_from_the_signed_event(self, catalog, fake_stripe) -> None:
        customer = make_customer(credit_ucents=0)
        topup, session = open_topup(fake_stripe, customer.user, 2_500)
        TopUp.objects.filter(pk=topup.pk).update(
            stripe_session_id=None, status=TopUp.Status.FAILED
        )  # Stripe's answer was lost
        assert deliver(checkout_completed_event(session)).json()["outcome"] == "credited"
        topup.refresh_from_db()
        assert (topup.status, topup.stripe_session_id) == (TopUp.Status.PAID, session["id"])
        assert balance(customer.user) == 2_500_000_000 and selectors.reconcile_report() == []


class PayoutAccountUpdatedTests:
    """Connect's `account.updated`: the owner who finished Stripe's onboarding but never came
    back through the return URL (closed the tab) is ready all the same."""

    def onboarding(self, fake_stripe: LocalStripe) -> PayoutProfile:
        host = make_host().host
        services.payout_account_onboard(
            host=host, return_url="http://testserver/back", refresh_url="http://testserver/again"
        )
        return PayoutProfile.objects.get(host=host)

    def test_a_finished_onboarding_marks_the_account_ready_once(self, catalog, fake_stripe) -> None:
        profile = self.onboarding(fake_stripe)
        account = fake_stripe.accounts[profile.stripe_account_id]
        assert deliver(event_body("account.updated", account)).json()["outcome"] == "ignored"  # not finished yet
        profile.refresh_from_db()
        assert profile.status == PayoutProfile.Status.ONBOARDING
        finished = {
            **account,
            "details_submitted": True,
            "payouts_enabled": True,
            "capabilities": {"transfers": "active"},
        }
        payload = event_body("account.updated", finished)
        assert deliver(payload).json()["outcome"] == "payout_ready"
        profile.refresh_from_db()
        assert profile.status == PayoutProfile.Status.READY
        assert deliver(payload).json()["outcome"] == "payout_ready"  # a replay: recorded once
        assert deliver(event_body("account.updated", finished)).json()["outcome"] == "ignored"  # already ready
        assert StripeEvent.objects.filter(type="account.updated").count() == 3

    def test_a_forged_account_updated_marks_nothing(self, catalog, fake_stripe) -> None:
        profile = self.onboarding(fake_stripe)
        finished = {
            **fake_stripe.accounts[profile.stripe_account_id],
            "details_submitted": True,
            "payouts_enabled": True,
            "capabilities": {"transfers": "active"},
        }
        payload = event_body("account.updated", finished)
        assert deliver(payload, signature=sign(payload, "whsec_someone_else")).status_code == 400
        profile.refresh_from_db()
        assert profile.status == PayoutProfile.Status.ONBOARDING and StripeEvent.objects.count() == 0

    def test_an_account_that_is_not_a_machines_is_ignored(self, catalog, fake_stripe) -> None:
        payload = event_body(
            "account.updated",
            {
                "id": "acct_stranger",
                "object": "account",
                "details_submitted": True,
                "capabilities": {"transfers": "active"},
            },
        )
        assert deliver(payload).json()["outcome"] == "ignored"
