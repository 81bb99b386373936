from __future__ import annotations

import uuid
from datetime import UTC, timedelta
from typing import TYPE_CHECKING

import httpx
import pytest
from django.test import Client

from billing import selectors, services
from billing.errors import InvalidAmount, PaymentProviderError, PayoutRefused
from billing.models import Account, LedgerTransaction, Payout, PayoutProfile
from conftest import make_customer, make_host
from testkit.evidence import drawn

if TYPE_CHECKING:
    from hosts.models import Host
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

    def test_a_rejection_cannot_void_a_payout_whose_transfer_may_be_in_flight(
        self, catalog, fake_stripe, settings
    ) -> None:
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
        done = market.job_complete(host=serving.host, job_id=job.pk, finish_reason="stop", token_ids=drawn(job.pk))
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
        response = client.post(
            "/billing/api/host/payouts",
            {},
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {serving.token}",
        )
        assert response.status_code == 201 and response.json()["amount_ucents"] == 1_600_000_000
        again = client.post(
            "/billing/api/host/payouts",
            {},
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {serving.token}",
        )
        assert again.status_code == 409 and again.json()["error"]["code"] == "payout_refused"
        assert client.get("/billing/api/host/statement", HTTP_AUTHORIZATION="Bearer host-nope").status_code == 401


class WithdrawEverythingWhileVestingTests:
    """ "Withdraw everything" while the money is still vesting says what is vesting and when it
    vests, not "the minimum payout is $10.00; this request is $0.00"."""

    def test_it_says_what_is_vesting_and_when_the_minimum_becomes_payable(self, catalog, settings) -> None:
        settings.EARNINGS_VEST_SECONDS = 7 * 86400
        serving = host_earning(2_000_000_000)  # $16.00 earned just now, all of it vesting
        earned_at = LedgerTransaction.objects.get(kind=LedgerTransaction.Kind.SETTLEMENT).created_at
        vests = (
            (earned_at + timedelta(days=7, seconds=59, microseconds=999_999))
            .astimezone(UTC)
            .strftime("%Y-%m-%d %H:%M UTC")
        )
        with pytest.raises(PayoutRefused) as refusal:
            services.payout_request(host=serving.host)
        assert refusal.value.message == (
            "$16.00 of this machine's earnings is still vesting "
            "(earnings become payable 7 days after each job) and $0.00 is "
            f"payable now, below the minimum payout of $10.00: the minimum is payable from {vests}."
        )
        assert Payout.objects.count() == 0

    def test_it_names_when_everything_has_vested_when_that_is_still_below_the_minimum(self, catalog, settings) -> None:
        settings.EARNINGS_VEST_SECONDS = 86400
        serving = host_earning(500_000_000)  # $4.00, vesting for a day
        with pytest.raises(
            PayoutRefused,
            match=r"\$4\.00 of this machine's earnings is still vesting .* all of it has vested "
            r"by \d{4}-\d\d-\d\d \d\d:\d\d UTC, \$4\.00 in all, still below the minimum\.$",
        ):
            services.payout_request(host=serving.host)

    def test_with_nothing_vesting_it_says_so(self, catalog) -> None:
        serving = host_earning(500_000_000)  # $4.00, vested at once (this module's setting)
        with pytest.raises(
            PayoutRefused,
            match=r"^There is \$4\.00 to withdraw and the minimum payout is \$10\.00; nothing more is vesting\.$",
        ):
            services.payout_request(host=serving.host)

    def test_the_schedule_adds_up_to_what_is_unvested(self, catalog, settings) -> None:
        settings.EARNINGS_VEST_SECONDS = 7 * 86400
        serving = host_earning(500_000_000)
        account = selectors.host_account(host=serving.host)
        ((moment, amount),) = selectors.host_vesting_schedule(account=account)
        assert amount == selectors.host_unvested_ucents(account=account) == 400_000_000
        assert moment == LedgerTransaction.objects.get(kind=LedgerTransaction.Kind.SETTLEMENT).created_at + timedelta(
            days=7
        )


class PayoutAccountOnboardTests:
    """The owner sets up their own payout account: a Stripe Connect account, its onboarding
    on Stripe's pages (local test mode's stand-in here), and the return URL's check."""

    RETURN, REFRESH = "http://testserver/machines/1/payout/return/", "http://testserver/machines/1/?payouts=expired"

    def onboard(self, host: Host) -> str | None:
        return services.payout_account_onboard(host=host, return_url=self.RETURN, refresh_url=self.REFRESH)

    def test_it_creates_an_express_account_and_sends_the_owner_to_its_onboarding(self, catalog, fake_stripe) -> None:
        host = make_host().host
        link = self.onboard(host)
        profile = PayoutProfile.objects.get(host=host)
        assert profile.status == PayoutProfile.Status.ONBOARDING and profile.stripe_account_id.startswith("acct_")
        assert link.startswith(f"{fake_stripe.url}/connect/onboarding/")
        create, linked = (call for call in fake_stripe.received if call.method == "POST")
        assert create.path == "/v1/accounts" and create.form["type"] == "express"
        assert create.form["capabilities[transfers][requested]"] == "true" and create.form["metadata[host_id]"] == str(
            host.pk
        )
        assert create.idempotency_key == f"payout-account-{host.pk}-first"
        assert linked.path == "/v1/account_links" and linked.form == {
            "account": profile.stripe_account_id,
            "type": "account_onboarding",
            "return_url": self.RETURN,
            "refresh_url": self.REFRESH,
        }
        with pytest.raises(PayoutRefused, match="has not finished Stripe's onboarding"):
            services.payout_request(host=host)

    def test_returning_proves_nothing_until_stripe_says_onboarding_finished(self, catalog, fake_stripe) -> None:
        host = make_host().host
        link = self.onboard(host)
        assert services.payout_account_refresh(host=host).status == PayoutProfile.Status.ONBOARDING  # came back early
        completed = httpx.post(link, timeout=5)
        assert completed.status_code == 303 and completed.headers["Location"] == self.RETURN
        assert services.payout_account_refresh(host=host).status == PayoutProfile.Status.READY
        assert self.onboard(host) is None, "nothing more to set up"
        assert httpx.post(link, timeout=5).headers["Location"] == self.REFRESH, "a link works once"

    def test_a_second_click_reuses_the_account_and_a_forgotten_one_is_replaced(self, catalog, fake_stripe) -> None:
        host = make_host().host
        self.onboard(host)
        first = PayoutProfile.objects.get(host=host).stripe_account_id
        self.onboard(host)
        assert PayoutProfile.objects.get(host=host).stripe_account_id == first
        fake_stripe.accounts.pop(first)  # the stand-in restarted: it forgot the account
        self.onboard(host)
        assert PayoutProfile.objects.get(host=host).stripe_account_id not in (first, "")

    def test_once_ready_the_owner_is_paid_without_an_operator_connecting_anything(self, catalog, fake_stripe) -> None:
        serving = make_host()
        customer = make_customer(credit_ucents=2_000_000_000)
        hold = services.hold_place(user=customer.user, api_key=customer.key, amount_ucents=2_000_000_000)
        services.hold_settle(hold=hold, cost_ucents=2_000_000_000, host=serving.host, reference=f"r-{uuid.uuid4()}")
        httpx.post(self.onboard(serving.host), timeout=5)
        services.payout_account_refresh(host=serving.host)
        paid = services.payout_approve(payout_id=services.payout_request(host=serving.host).pk)
        assert (
            paid.status == Payout.Status.PAID
            and paid.destination == PayoutProfile.objects.get(host=serving.host).stripe_account_id
        )

    def test_a_banned_machine_cannot_set_up_payouts(self, catalog, fake_stripe) -> None:
        from hosts.services import host_ban

        host = make_host().host
        host_ban(host=host, reason="served made-up text", by="operator")
        with pytest.raises(PayoutRefused, match="banned"):
            self.onboard(host)
        assert fake_stripe.received == []
