"""The operator's admin across apps, through the real admin as a superuser."""
from __future__ import annotations

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
    def test_every_model_is_registered_and_its_changelist_answers(self, operator, customer, serving_host, app: str) -> None:
        from django.apps import apps
        from django.contrib import admin

        for model in apps.get_app_config(app).get_models():
            assert admin.site.is_registered(model), model
            url = f"/admin/{app}/{model._meta.model_name}/"
            assert operator.get(url).status_code == 200, url
            assert operator.get(url + "?q=x").status_code == 200, url
