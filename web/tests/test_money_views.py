"""The money pages in local test mode: the top-up form states its rule, Checkout returns to
the gateway as the visitor reached it, every page says it is test mode, and a machine's
owner sets up their own payout account."""

from __future__ import annotations

import re

import httpx
import pytest

from billing.models import PayoutProfile, TopUp

pytestmark = pytest.mark.django_db

RULE = "Top-ups are between $5.00 and $500.00."


class TopupFormTests:
    def test_the_dashboard_shows_the_range_on_the_form(self, customer_client, fake_stripe) -> None:
        page = customer_client.get("/").content.decode()
        assert RULE in page
        (field,) = re.findall(r'<input[^>]*name="amount_usd"[^>]*>', page)
        assert 'min="5.00"' in field and 'max="500.00"' in field and 'step="0.01"' in field

    @pytest.mark.parametrize(
        ("amount", "answer"),
        [
            ("1", RULE),
            ("4.99", RULE),
            ("500.01", RULE),
            ("0", RULE),
            ("-5", RULE),
            ("99999999", RULE),
            ("twenty", f"Enter an amount in USD, e.g. 20. {RULE}"),
            ("", f"Enter an amount in USD. {RULE}"),
            ("5.001", "Enter the amount in whole cents (at most two decimals)."),
        ],
    )
    def test_every_bad_amount_is_answered_with_the_rule_it_breaks(
        self, customer_client, fake_stripe, amount, answer
    ) -> None:
        response = customer_client.post("/topup/", {"amount_usd": amount}, follow=True)
        (message,) = (str(m) for m in response.context["messages"])
        assert message == answer and TopUp.objects.count() == 0 and fake_stripe.received == []

    def test_checkout_returns_to_the_gateway_as_the_visitor_reached_it(self, customer_client, fake_stripe) -> None:
        customer_client.post("/topup/", {"amount_usd": "20"}, HTTP_HOST="127.0.0.1:8091")
        (call,) = fake_stripe.received
        assert call.form["success_url"] == "http://127.0.0.1:8091/?topup=success"
        assert call.form["cancel_url"] == "http://127.0.0.1:8091/?topup=cancelled"
        customer_client.post("/topup/", {"amount_usd": "20"}, HTTP_HOST="localhost:8443", secure=True)
        assert fake_stripe.received[-1].form["success_url"] == "https://localhost:8443/?topup=success"


class TestModeBannerTests:
    PAGES = ("/", "/keys/", "/usage/", "/models/", "/quickstart/", "/machines/")

    def test_every_page_says_it_is_test_mode_with_the_local_stand_in(self, customer_client, fake_stripe) -> None:
        for path in self.PAGES:
            assert 'id="test-mode"' in customer_client.get(path).content.decode(), path
        from django.test import Client

        assert "local Stripe stand-in" in Client().get("/login/").content.decode()  # signed out too

    def test_stripes_own_test_keys_are_labelled_and_live_keys_are_not(self, customer_client, settings) -> None:
        settings.STRIPE_API_BASE, settings.STRIPE_WEBHOOK_SECRET = "", "whsec_x"
        settings.STRIPE_SECRET_KEY = "sk_test_abc"
        assert "Stripe test keys" in customer_client.get("/").content.decode()
        settings.STRIPE_SECRET_KEY = "sk_live_abc"
        assert 'id="test-mode"' not in customer_client.get("/").content.decode()

    def test_without_stripe_there_is_no_banner(self, customer_client, no_stripe) -> None:
        assert 'id="test-mode"' not in customer_client.get("/").content.decode()


class PayoutSetupTests:
    def test_the_owner_sets_up_payouts_on_the_stand_ins_page_and_comes_back_ready(
        self, serving_host, host_client, fake_stripe
    ) -> None:
        host = serving_host.host
        page = host_client.get(f"/machines/{host.pk}/").content.decode()
        assert "Set up payouts" in page and "Request payout" not in page
        started = host_client.post(f"/machines/{host.pk}/payout/setup/")
        assert started.status_code == 302 and started["Location"].startswith(f"{fake_stripe.url}/connect/onboarding/")
        onboarding = httpx.get(started["Location"], timeout=5)
        assert onboarding.status_code == 200 and "TEST MODE" in onboarding.text
        completed = httpx.post(started["Location"], timeout=5)
        assert completed.headers["Location"] == f"http://testserver/machines/{host.pk}/payout/return/"
        back = host_client.get(f"/machines/{host.pk}/payout/return/", follow=True).content.decode()
        profile = PayoutProfile.objects.get(host=host)
        assert profile.status == PayoutProfile.Status.READY
        assert (
            f"Payouts for {host.name} are set up" in back
            and profile.stripe_account_id in back
            and "Request payout" in back
        )

    def test_coming_back_without_finishing_says_so(self, serving_host, host_client, fake_stripe) -> None:
        host = serving_host.host
        host_client.post(f"/machines/{host.pk}/payout/setup/")
        back = host_client.get(f"/machines/{host.pk}/payout/return/", follow=True).content.decode()
        assert (
            "not finished yet" in back
            and PayoutProfile.objects.get(host=host).status == PayoutProfile.Status.ONBOARDING
        )

    def test_an_outsider_cannot_set_up_payouts_for_someone_elses_machine(
        self, serving_host, outsider_client, fake_stripe
    ) -> None:
        assert outsider_client.post(f"/machines/{serving_host.host.pk}/payout/setup/").status_code == 404
        assert outsider_client.get(f"/machines/{serving_host.host.pk}/payout/return/").status_code == 404
        assert fake_stripe.received == [] and not PayoutProfile.objects.exists()

    def test_withdrawing_everything_while_it_vests_says_when_it_vests(
        self, customer, serving_host, host_client, settings
    ) -> None:
        from web.tests.factories import finished_request

        PayoutProfile.objects.create(host=serving_host.host, stripe_account_id="acct_test")
        finished_request(customer=customer, host=serving_host.host, cost_ucents=10_000_000)  # 8 cents, vesting 7 days
        page = host_client.post(f"/machines/{serving_host.host.pk}/payout/", {}, follow=True).content.decode()
        assert "$0.08 of this machine&#x27;s earnings is still vesting" in page and "this request is $0.00" not in page
