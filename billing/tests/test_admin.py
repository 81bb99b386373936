from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from billing import selectors
from billing.models import LedgerTransaction
from conftest import make_customer

pytestmark = pytest.mark.django_db


class GrantAdminTests:
    def test_an_operator_grants_credit_as_a_ledger_grant_with_a_reason(self, catalog) -> None:
        customer = make_customer(credit_ucents=1)
        account = selectors.customer_account(user=customer.user)
        operator = get_user_model().objects.create_superuser("ops", "ops@example.com", "pw-long-enough")
        client = Client()
        client.force_login(operator)
        url = f"/admin/billing/account/{account.pk}/grant/"
        assert client.get(url).status_code == 200
        response = client.post(url, {"amount_usd": "12.5", "reason": "goodwill for an outage"})
        assert response.status_code == 302
        grant = LedgerTransaction.objects.filter(kind="grant", memo__startswith="goodwill").get()
        assert grant.memo == "goodwill for an outage (by ops)"
        assert selectors.customer_account(user=customer.user).balance_ucents == 1 + 1_250_000_000
        assert selectors.reconcile_report() == []

    def test_every_billing_model_is_in_the_admin(self, catalog) -> None:
        from django.apps import apps
        from django.contrib import admin

        for model in apps.get_app_config("billing").get_models():
            assert admin.site.is_registered(model), model
