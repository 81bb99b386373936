from __future__ import annotations

import uuid

import pytest

from billing import selectors, services
from billing.errors import InsufficientCredit, KeyLimitExceeded
from billing.models import Account, Hold, LedgerTransaction
from catalog.money import usd_to_ucents
from conftest import make_customer, make_host

pytestmark = pytest.mark.django_db


def test_usd_to_ucents_is_exact_and_refuses_sub_microcent() -> None:
    assert usd_to_ucents("5") == 500_000_000
    assert usd_to_ucents("0.00000001") == 1
    with pytest.raises(ValueError):
        usd_to_ucents("0.000000001")
    with pytest.raises(ValueError):
        usd_to_ucents("five")


class CreditGrantTests:
    def test_it_credits_the_customer_from_funding_in_one_balanced_transaction(self, catalog) -> None:
        customer = make_customer(credit_ucents=0)
        services.credit_grant(user=customer.user, amount_ucents=1234, reference="g1")
        account = selectors.customer_account(user=customer.user)
        assert account.balance_ucents == 1234
        assert services.system_account(Account.Kind.FUNDING).balance_ucents == -1234
        assert selectors.ledger_total() == 0
        assert selectors.cache_drift() == []

    def test_it_refuses_a_second_grant_with_the_same_reference(self, catalog) -> None:
        from django.db import IntegrityError

        customer = make_customer(credit_ucents=0)
        services.credit_grant(user=customer.user, amount_ucents=10, reference="dup")
        with pytest.raises(IntegrityError):
            services.credit_grant(user=customer.user, amount_ucents=10, reference="dup")


class HoldTests:
    def test_it_reserves_credit_and_refuses_what_is_not_covered(self, catalog) -> None:
        customer = make_customer(credit_ucents=1000)
        services.hold_place(user=customer.user, api_key=customer.key, amount_ucents=600)
        with pytest.raises(InsufficientCredit):
            services.hold_place(user=customer.user, api_key=customer.key, amount_ucents=401)
        services.hold_place(user=customer.user, api_key=customer.key, amount_ucents=400)
        account = selectors.customer_account(user=customer.user)
        assert (account.balance_ucents, account.held_ucents, account.available_ucents) == (1000, 1000, 0)

    def test_it_refuses_past_the_key_cap_with_the_key_reason(self, catalog) -> None:
        customer = make_customer(credit_ucents=10_000, cap_ucents=500)
        services.hold_place(user=customer.user, api_key=customer.key, amount_ucents=500)
        with pytest.raises(KeyLimitExceeded):
            services.hold_place(user=customer.user, api_key=customer.key, amount_ucents=1)

    def test_it_releases_once(self, catalog) -> None:
        customer = make_customer(credit_ucents=1000)
        hold = services.hold_place(user=customer.user, api_key=customer.key, amount_ucents=700)
        assert services.hold_release(hold=hold) is True
        assert services.hold_release(hold=hold) is False
        assert selectors.customer_account(user=customer.user).held_ucents == 0
        customer.key.refresh_from_db()
        assert customer.key.held_ucents == 0


class SettlementTests:
    def test_it_splits_80_20_in_integers_and_never_loses_a_microcent(self, catalog) -> None:
        customer = make_customer(credit_ucents=10_000)
        serving = make_host()
        hold = services.hold_place(user=customer.user, api_key=customer.key, amount_ucents=1_000)
        split = services.hold_settle(hold=hold, cost_ucents=999, host=serving.host, reference="r1")
        assert (split.cost_ucents, split.host_ucents, split.platform_ucents) == (999, 799, 200)
        assert selectors.customer_account(user=customer.user).balance_ucents == 10_000 - 999
        assert selectors.host_account(host=serving.host).balance_ucents == 799
        assert services.system_account(Account.Kind.PLATFORM).balance_ucents == 200
        assert selectors.ledger_total() == 0
        assert selectors.unbalanced_transactions() == []
        assert selectors.cache_drift() == []

    def test_it_settles_exactly_once(self, catalog) -> None:
        customer = make_customer(credit_ucents=10_000)
        serving = make_host()
        hold = services.hold_place(user=customer.user, api_key=customer.key, amount_ucents=1_000)
        assert services.hold_settle(hold=hold, cost_ucents=500, host=serving.host, reference="once") is not None
        assert (
            services.hold_settle(
                hold=Hold.objects.get(pk=hold.pk), cost_ucents=500, host=serving.host, reference="once"
            )
            is None
        )
        assert LedgerTransaction.objects.filter(reference="once").count() == 1
        customer.key.refresh_from_db()
        assert (customer.key.spent_ucents, customer.key.held_ucents) == (500, 0)

    def test_it_refuses_a_cost_above_the_hold(self, catalog) -> None:
        customer = make_customer(credit_ucents=10_000)
        hold = services.hold_place(user=customer.user, api_key=customer.key, amount_ucents=100)
        with pytest.raises(ValueError):
            services.hold_settle(hold=hold, cost_ucents=101, host=make_host().host, reference=str(uuid.uuid4()))
