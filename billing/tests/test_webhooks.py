from __future__ import annotations

import json
import random
import time
from typing import TYPE_CHECKING

import pytest
from django.test import Client

from billing import selectors, services
from billing.models import Account, LedgerTransaction, StripeEvent, TopUp
from billing.tests.conftest import WEBHOOK_SECRET
from billing.tests.stripe_fake import checkout_completed_event, sign
from conftest import make_customer

if TYPE_CHECKING:
    from django.contrib.auth.models import User
    from django.test.client import _MonkeyPatchedWSGIResponse as TestResponse

    from billing.tests.stripe_fake import FakeStripe

pytestmark = pytest.mark.django_db

URL = "/billing/stripe/webhook/"


def deliver(payload: str, signature: str | None = None) -> TestResponse:
    header = sign(payload, WEBHOOK_SECRET) if signature is None else signature
    return Client().post(URL, data=payload.encode(), content_type="application/json", HTTP_STRIPE_SIGNATURE=header)


def open_topup(fake_stripe: FakeStripe, user: User, cents: int) -> tuple[TopUp, dict]:
    topup = services.topup_create(user=user, amount_cents=cents)
    return topup, fake_stripe.sessions[topup.stripe_session_id]


def balance(user: User) -> int:
    account = selectors.customer_account(user=user)
    return account.balance_ucents if account else 0


class WebhookCreditTests:
    def test_it_credits_every_event_once_when_each_is_delivered_three_times_shuffled(self, catalog, fake_stripe) -> None:
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
        session = {"id": "cs_test_stranger", "object": "checkout.session", "amount_total": 1_000, "currency": "usd",
                   "client_reference_id": "1", "metadata": {}}
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
