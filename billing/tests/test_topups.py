from __future__ import annotations

import pytest
from django.test import Client

from billing import selectors, services
from billing.errors import InvalidAmount, TopupsNotConfigured
from billing.models import TopUp
from billing.tests.conftest import BACK
from conftest import make_customer

pytestmark = pytest.mark.django_db


class TopupCreateTests:
    def test_it_creates_a_checkout_session_for_the_amount_and_credits_nothing_yet(self, catalog, fake_stripe) -> None:
        customer = make_customer(credit_ucents=0)
        topup = services.topup_create(user=customer.user, amount_cents=2_000, **BACK)
        assert topup.status == TopUp.Status.OPEN
        assert topup.stripe_session_id.startswith("cs_test_")
        assert topup.checkout_url == f"{fake_stripe.url}/c/pay/{topup.stripe_session_id}"  # its payment page
        (call,) = fake_stripe.received
        assert call.path == "/v1/checkout/sessions"
        assert call.authorization == "Bearer sk_test_local"
        assert call.idempotency_key == f"topup-{topup.pk}"
        assert call.form["success_url"] == BACK["success_url"] and call.form["cancel_url"] == BACK["cancel_url"]
        assert call.form["mode"] == "payment"
        assert call.form["client_reference_id"] == str(topup.pk)
        assert call.form["line_items[0][price_data][unit_amount]"] == "2000"
        assert call.form["line_items[0][price_data][currency]"] == "usd"
        assert selectors.customer_account(user=customer.user) is None  # no account, no credit

    def test_it_refuses_amounts_outside_the_limits_stating_them(self, catalog, fake_stripe, settings) -> None:
        customer = make_customer(credit_ucents=0)
        with pytest.raises(InvalidAmount, match=r"^Top-ups are between \$5\.00 and \$500\.00\.$"):
            services.topup_create(user=customer.user, amount_cents=settings.TOPUP_MIN_CENTS - 1, **BACK)
        with pytest.raises(InvalidAmount):
            services.topup_create(user=customer.user, amount_cents=settings.TOPUP_MAX_CENTS + 1, **BACK)
        assert fake_stripe.received == [] and TopUp.objects.count() == 0

    def test_it_says_top_ups_are_not_configured_without_stripe_keys(self, catalog, no_stripe) -> None:
        customer = make_customer(credit_ucents=0)
        with pytest.raises(TopupsNotConfigured, match="not configured"):
            services.topup_create(user=customer.user, amount_cents=1_000, **BACK)


class TopupApiTests:
    def test_it_answers_the_checkout_url(self, catalog, fake_stripe) -> None:
        customer = make_customer(credit_ucents=0)
        response = Client().post(
            "/billing/api/topups",
            {"amount_usd": "25.00"},
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {customer.secret}",
        )
        assert response.status_code == 201, response.content
        body = response.json()
        assert body["amount_cents"] == 2_500 and body["amount_ucents"] == 2_500_000_000
        assert body["checkout_url"] == f"{fake_stripe.url}/c/pay/{TopUp.objects.get().stripe_session_id}"

    def test_it_sends_stripe_back_to_the_gateway_as_the_caller_reached_it(self, catalog, fake_stripe) -> None:
        customer = make_customer(credit_ucents=0)
        Client().post(
            "/billing/api/topups",
            {"amount_usd": "25"},
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {customer.secret}",
            HTTP_HOST="127.0.0.1:8091",
        )
        (call,) = fake_stripe.received
        assert call.form["success_url"] == "http://127.0.0.1:8091/?topup=success"
        assert call.form["cancel_url"] == "http://127.0.0.1:8091/?topup=cancelled"

    def test_it_answers_503_not_configured_in_openai_format(self, catalog, no_stripe) -> None:
        customer = make_customer(credit_ucents=0)
        response = Client().post(
            "/billing/api/topups",
            {"amount_usd": "25"},
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {customer.secret}",
        )
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "topups_not_configured"

    def test_it_refuses_an_outsider(self, catalog, fake_stripe) -> None:
        response = Client().post(
            "/billing/api/topups",
            {"amount_usd": "25"},
            content_type="application/json",
            HTTP_AUTHORIZATION="Bearer el-nope",
        )
        assert response.status_code == 401 and fake_stripe.received == []

    def test_it_refuses_a_too_small_amount_with_400(self, catalog, fake_stripe) -> None:
        customer = make_customer(credit_ucents=0)
        response = Client().post(
            "/billing/api/topups",
            {"amount_usd": "0.10"},
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {customer.secret}",
        )
        assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_amount"
