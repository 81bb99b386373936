from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

import pytest
from django.test import Client

from billing import selectors, services
from billing.errors import InvalidAmount, PaymentProviderError, PayoutRefused
from billing.models import Account, LedgerTransaction, Payout, PayoutProfile
from conftest import make_customer, make_host

if TYPE_CHECKING:
    from testkit.personas import ServingHost

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _vested_at_once(settings) -> None:
    """These tests pay out earnings; vesting (payable only after a holding period) has its own
    tests in marketplace/tests/test_reputation.py."""
    settings.EARNINGS_VEST_SECONDS = 0


def host_earning(ucents_cost: int, *, account_id: str = "acct_1Host") -> ServingHost:
    """A host with a payout account that earned 80% of `ucents_cost`."""
    serving = make_host()
    PayoutProfile.objects.create(host=serving.host, stripe_account_id=account_id)
    customer = make_customer(credit_ucents=ucents_cost)
    hold = services.hold_place(user=customer.user, api_key=customer.key, amount_ucents=ucents_cost)
    services.hold_settle(hold=hold, cost_ucents=ucents_cost, host=serving.host, reference=f"r-{uuid.uuid4()}")
    return serving


def balance_of(account: Account | None) -> int:
    return account.balance_ucents if account else 0


class PayoutRequestTests:
    def test_it_moves_all_available_whole_cents_to_pending(self, catalog) -> None:
        serving = host_earning(2_000_001_250)  # host earns 1,600,001,000 µ¢
        payout = services.payout_request(host=serving.host)
        assert payout.amount_ucents == 1_600_000_000 and payout.status == Payout.Status.REQUESTED
        assert selectors.host_account(host=serving.host).balance_ucents == 1_000
        assert services.system_account(Account.Kind.PAYOUTS_PENDING).balance_ucents == 1_600_000_000
        assert selectors.reconcile_report() == []

    def test_it_refuses_below_the_minimum_above_the_available_and_fractions_of_a_cent(self, catalog, settings) -> None:
        serving = host_earning(2_000_000_000)
        with pytest.raises(PayoutRefused, match="minimum"):
            services.payout_request(host=serving.host, amount_ucents=settings.PAYOUT_MINIMUM_UCENTS - 1_000_000)
        with pytest.raises(PayoutRefused, match="available"):
            services.payout_request(host=serving.host, amount_ucents=1_601_000_000)
        with pytest.raises(InvalidAmount):
            services.payout_request(host=serving.host, amount_ucents=1_500_000_001)
        assert Payout.objects.count() == 0

    def test_it_refuses_a_host_without_a_payout_account(self, catalog) -> None:
        with pytest.raises(PayoutRefused, match="payout account"):
            services.payout_request(host=make_host().host)

    def test_it_refuses_a_banned_host_its_vested_earnings(self, catalog) -> None:
        from hosts.services import host_ban

        serving = host_earning(2_000_000_000)
        host_ban(host=serving.host, reason="served made-up text", by="operator")
        with pytest.raises(PayoutRefused, match="banned"):
            services.payout_request(host=serving.host)  # (the caller's row, loaded before the ban)
        assert Payout.objects.count() == 0
        assert selectors.host_account(host=serving.host).balance_ucents == 1_600_000_000

    def test_it_cannot_withdraw_the_same_earnings_twice(self, catalog) -> None:
        serving = host_earning(2_000_000_000)
        services.payout_request(host=serving.host, amount_ucents=1_000_000_000)
        with pytest.raises(PayoutRefused):
            services.payout_request(host=serving.host, amount_ucents=1_000_000_000)


class PayoutApproveTests:
    def test_it_sends_a_transfer_keyed_by_the_payout_and_posts_it(self, catalog, fake_stripe) -> None:
        serving = host_earning(2_000_000_000)
        payout = services.payout_request(host=serving.host)
        paid = services.payout_approve(payout_id=payout.pk)
        assert paid.status == Payout.Status.PAID and paid.stripe_transfer_id.startswith("tr_")
        (call,) = fake_stripe.received
        assert call.path == "/v1/transfers" and call.idempotency_key == f"payout-{payout.pk}"
        assert (call.form["amount"], call.form["currency"], call.form["destination"]) == ("1600", "usd", "acct_1Host")
        assert services.system_account(Account.Kind.PAYOUTS_PENDING).balance_ucents == 0
        assert LedgerTransaction.objects.filter(reference=f"payout-{payout.pk}").count() == 2
        assert selectors.reconcile_report() == []
        with pytest.raises(PayoutRefused, match="already paid"):
            services.payout_approve(payout_id=payout.pk)

    def test_it_voids_and_returns_the_earnings_when_stripe_refuses(self, catalog, fake_stripe) -> None:
        fake_stripe.refuse_transfers = True
        serving = host_earning(2_000_000_000)
        payout = services.payout_approve(payout_id=services.payout_request(host=serving.host).pk)
        assert payout.status == Payout.Status.FAILED and "insufficient" in payout.failure_reason
        assert selectors.host_account(host=serving.host).balance_ucents == 1_600_000_000
        assert services.system_account(Account.Kind.PAYOUTS_PENDING).balance_ucents == 0
        assert selectors.reconcile_report() == []

    def test_it_leaves_an_unknown_outcome_sending_and_a_retry_pays_once(self, catalog, fake_stripe, settings) -> None:
        serving = host_earning(2_000_000_000)
        payout = services.payout_request(host=serving.host)
        settings.STRIPE_API_BASE = "http://127.0.0.1:9"  # nothing listens: the outcome is unknown
        with pytest.raises(PaymentProviderError):
            services.payout_approve(payout_id=payout.pk)
        assert Payout.objects.get(pk=payout.pk).status == Payout.Status.SENDING
        settings.STRIPE_API_BASE = fake_stripe.url
        assert services.payout_approve(payout_id=payout.pk).status == Payout.Status.PAID
        assert services.system_account(Account.Kind.FUNDING).balance_ucents == -2_000_000_000 + 1_600_000_000

    def test_an_operator_rejection_returns_the_earnings(self, catalog) -> None:
        serving = host_earning(2_000_000_000)
        payout = services.payout_request(host=serving.host)
        assert services.payout_void(payout_id=payout.pk, reason="rejected") is True
        assert services.payout_void(payout_id=payout.pk, reason="rejected") is False
        assert selectors.host_account(host=serving.host).balance_ucents == 1_600_000_000

    def test_a_rejection_cannot_void_a_payout_whose_transfer_may_be_in_flight(self, catalog, fake_stripe, settings) -> None:
        serving = host_earning(2_000_000_000)
        payout = services.payout_request(host=serving.host)
        settings.STRIPE_API_BASE = "http://127.0.0.1:9"  # approved; Stripe's answer is lost: the transfer may be out
        with pytest.raises(PaymentProviderError):
            services.payout_approve(payout_id=payout.pk)
        assert services.payout_void(payout_id=payout.pk, reason="rejected after approval") is False
        assert selectors.host_account(host=serving.host).balance_ucents == 0, "the earnings are not given back twice"
        settings.STRIPE_API_BASE = fake_stripe.url
        assert services.payout_approve(payout_id=payout.pk).status == Payout.Status.PAID
        assert selectors.reconcile_report() == []


class HostBillingApiTests:
    def test_the_statement_lists_jobs_and_payouts_without_customer_identity(self, catalog) -> None:
        from marketplace import services as market
        from testkit.requests import submit_request

        customer = make_customer()
        serving = make_host()
        request = submit_request(customer, catalog, max_tokens=5, prompt_tokens=3)
        job = market.job_claim_next(host=serving.host, fingerprint=serving.fingerprint)
        market.job_push_tokens(host=serving.host, job_id=job.pk, seq=0, text="Hello there")
        done = market.job_complete(host=serving.host, job_id=job.pk, finish_reason="stop")
        response = Client().get("/billing/api/host/statement", HTTP_AUTHORIZATION=f"Bearer {serving.token}")
        assert response.status_code == 200
        body = response.json()
        assert body["balance_ucents"] == done.earned_ucents == body["jobs"][0]["earned_ucents"]
        assert body["jobs"][0]["completion_tokens"] == done.request.completion_tokens
        flat = response.content.decode()
        for secret in (customer.user.username, customer.key.prefix, request.public_id):
            assert secret not in flat

    def test_a_host_requests_a_payout_over_the_api(self, catalog) -> None:
        serving = host_earning(2_000_000_000)
        client = Client()
        response = client.post("/billing/api/host/payouts", {}, content_type="application/json",
                               HTTP_AUTHORIZATION=f"Bearer {serving.token}")
        assert response.status_code == 201 and response.json()["amount_ucents"] == 1_600_000_000
        again = client.post("/billing/api/host/payouts", {}, content_type="application/json",
                            HTTP_AUTHORIZATION=f"Bearer {serving.token}")
        assert again.status_code == 409 and again.json()["error"]["code"] == "payout_refused"
        assert client.get("/billing/api/host/statement", HTTP_AUTHORIZATION="Bearer host-nope").status_code == 401
