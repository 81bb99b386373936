"""The operator's admin across apps, through the real admin as a superuser."""

from __future__ import annotations

import re
import uuid

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from accounts.models import ApiKey
from conftest import make_customer

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator() -> Client:
    client = Client()
    client.force_login(get_user_model().objects.create_superuser("ops", "ops@example.com", "pw-long-enough"))
    return client


def credits_status(secret: str) -> int:
    """GET /v1/credits checks the key (GET /v1/models answers anyone)."""
    return Client().get("/v1/credits", HTTP_AUTHORIZATION=f"Bearer {secret}").status_code


class ApiKeyAdminTests:
    def test_revoke_selected_keys_refuses_them_at_once(self, operator, customer, catalog) -> None:
        bystander = make_customer()
        assert credits_status(customer.secret) == 200
        response = operator.post(
            "/admin/accounts/apikey/", {"action": "revoke", "_selected_action": [customer.key.pk], "index": "0"}
        )
        assert response.status_code == 302
        assert ApiKey.objects.get(pk=customer.key.pk).revoked_at is not None
        assert credits_status(customer.secret) == 401
        assert credits_status(bystander.secret) == 200

    def test_revoking_again_keeps_the_first_revocation_time(self, operator, customer) -> None:
        action = {"action": "revoke", "_selected_action": [customer.key.pk], "index": "0"}
        operator.post("/admin/accounts/apikey/", action)
        first = ApiKey.objects.get(pk=customer.key.pk).revoked_at
        response = operator.post("/admin/accounts/apikey/", action, follow=True)
        assert "1 were already revoked" in response.content.decode()
        assert ApiKey.objects.get(pk=customer.key.pk).revoked_at == first

    def test_the_list_filters_live_and_revoked_keys(self, operator, customer) -> None:
        other = make_customer()
        operator.post("/admin/accounts/apikey/", {"action": "revoke", "_selected_action": [other.key.pk], "index": "0"})
        live = operator.get("/admin/accounts/apikey/?revoked=no").content.decode()
        revoked = operator.get("/admin/accounts/apikey/?revoked=yes").content.decode()
        assert customer.key.prefix in live and other.key.prefix not in live
        assert other.key.prefix in revoked and customer.key.prefix not in revoked

    def test_no_page_shows_a_key_hash_or_secret(self, operator, customer) -> None:
        pages = [
            operator.get("/admin/accounts/apikey/").content.decode(),
            operator.get(f"/admin/accounts/apikey/{customer.key.pk}/change/").content.decode(),
        ]
        for page in pages:
            assert customer.key.prefix in page
            assert customer.key.key_hash not in page and customer.secret not in page


class AdminCoverageTests:
    @pytest.mark.parametrize("app", ["hosts", "marketplace", "billing"])
    def test_every_model_is_registered_and_its_changelist_answers(
        self, operator, customer, serving_host, app: str
    ) -> None:
        from django.apps import apps
        from django.contrib import admin

        for model in apps.get_app_config(app).get_models():
            assert admin.site.is_registered(model), model
            url = f"/admin/{app}/{model._meta.model_name}/"
            assert operator.get(url).status_code == 200, url
            assert operator.get(url + "?q=x").status_code == 200, url


class MoneyInAdminTests:
    """Every amount the admin shows reads in dollars, never as raw µ¢."""

    RAW = [str(n) for n in (499_968_700, 12_345_678, 9_876_544)]  # the amounts below, as stored

    @pytest.fixture
    def ledger(self, catalog) -> dict:
        from billing.models import TopUp
        from billing.services import credit_grant
        from marketplace.models import Job, Request
        from web.tests.factories import finished_request

        customer = make_customer(credit_ucents=300_000_000)
        paid = credit_grant(
            user=customer.user, amount_ucents=200_000_000, reference=f"test-{uuid.uuid4()}"
        )  # a $2 top-up's
        topup = TopUp.objects.create(user=customer.user, amount_cents=2_00, status="paid", transaction=paid)
        request = finished_request(customer=customer, cost_ucents=31_300)  # balance 499,968,700 µ¢
        Request.objects.filter(pk=request.pk).update(cost_ucents=12_345_678, estimate_ucents=12_345_678)
        Job.objects.filter(request=request).update(earned_ucents=9_876_544)
        return {"customer": customer, "request": request, "topup": topup}

    def pages(self, operator: Client, ledger: dict) -> dict[str, str]:
        from billing.models import Account
        from marketplace.models import Job

        account = Account.objects.get(user=ledger["customer"].user)
        job = Job.objects.get(request=ledger["request"])
        urls = [
            "/admin/billing/account/",
            f"/admin/billing/account/{account.pk}/change/",
            "/admin/billing/ledgerentry/",
            "/admin/billing/hold/",
            "/admin/billing/topup/",
            f"/admin/billing/topup/{ledger['topup'].pk}/change/",
            "/admin/marketplace/request/",
            f"/admin/marketplace/request/{ledger['request'].pk}/change/",
            "/admin/marketplace/job/",
            f"/admin/marketplace/job/{job.pk}/change/",
            "/admin/accounts/apikey/",
            f"/admin/accounts/apikey/{ledger['customer'].key.pk}/change/",
            "/admin/catalog/catalogmodel/",
        ]
        return {url: operator.get(url).content.decode() for url in urls}

    def test_no_page_shows_a_raw_micro_cent_amount(self, operator, ledger) -> None:
        for url, page in self.pages(operator, ledger).items():
            for raw in self.RAW:
                assert not re.search(rf">\s*{raw}\s*<", page), f"{url} shows {raw} raw"

    def test_amounts_read_as_dollars(self, operator, ledger) -> None:
        pages = self.pages(operator, ledger)
        assert "$4.999687" in pages["/admin/billing/account/"]  # the balance, exactly
        assert (
            "$0.12345678" in pages["/admin/marketplace/request/"] and "$0.09876544" in pages["/admin/marketplace/job/"]
        )
        assert "$2.00" in pages["/admin/billing/topup/"]
        assert "$0.10 / 1M tokens" in pages["/admin/catalog/catalogmodel/"]
        request_page = pages[f"/admin/marketplace/request/{ledger['request'].pk}/change/"]
        assert "$0.12345678" in request_page and "$0.09876544" in request_page  # the job inline too

    def test_a_money_field_an_operator_edits_keeps_its_raw_value(self, operator, customer) -> None:
        from accounts.models import ApiKey

        ApiKey.objects.filter(pk=customer.key.pk).update(spend_cap_ucents=700_000_000)
        page = operator.get(f"/admin/accounts/apikey/{customer.key.pk}/change/").content.decode()
        assert 'name="spend_cap_ucents"' in page and 'value="700000000"' in page
