"""The two limits a hold must fit (`billing.holds`: the credit and the key's spend cap) in
both their forms — the SQL of admission's compare-and-set and the check of a locked row that
says why — over rows at and around each limit: the forms agree with each other and with
the rule as stated here, and the two admission paths admit and refuse the same holds."""

from __future__ import annotations

import pytest
from django.db import connection, transaction

from accounts.models import ApiKey
from billing.errors import BillingError, InsufficientCredit, KeyLimitExceeded
from billing.holds import CREDIT, KEY_CAP, Limit, hold_place, hold_steps
from billing.models import Account
from conftest import make_customer
from core.db import ChainMissed, chain_run

pytestmark = pytest.mark.django_db

USD = 100_000_000
ACCOUNTS = [(10 * USD, 0), (10 * USD, 4 * USD), (10 * USD, 10 * USD), (-USD, 0)]  # (balance, held)
KEYS = [
    (None, 0, 0),
    (None, 50 * USD, 5 * USD),
    (10 * USD, 0, 0),
    (10 * USD, 3 * USD, 2 * USD),
    (10 * USD, 6 * USD, 4 * USD),
]
AMOUNTS = [0, 1, 5 * USD, 6 * USD, 10 * USD, 10 * USD + 1]


def credit_covers(balance: int, held: int, amount: int) -> bool:
    return balance - held >= amount


def cap_covers(cap: int | None, spent: int, held: int, amount: int) -> bool:
    return cap is None or spent + held + amount <= cap


def fits_by_sql(limit: Limit, pk: int, amount: int) -> bool:
    condition, params = limit.sql(amount)
    table = connection.ops.quote_name(limit.model._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT id FROM {table} WHERE id = %s AND {condition}", [pk, *params])
        return cursor.fetchone() is not None


def customer_with(*, account: tuple[int, int], key: tuple[int | None, int, int]) -> tuple[Account, ApiKey]:
    customer = make_customer(credit_ucents=0)
    Account.objects.filter(kind=Account.Kind.CUSTOMER, user=customer.user).delete()
    balance, held = account
    row = Account.objects.create(
        kind=Account.Kind.CUSTOMER, user=customer.user, balance_ucents=balance, held_ucents=held
    )
    cap, spent, key_held = key
    ApiKey.objects.filter(pk=customer.key.pk).update(spend_cap_ucents=cap, spent_ucents=spent, held_ucents=key_held)
    return row, ApiKey.objects.get(pk=customer.key.pk)


class Undo(Exception):
    """Rolls a trial hold back."""


def chained(key: ApiKey, amount: int) -> bool:
    """Whether admission's statement chain places the hold (then undone)."""
    try:
        with transaction.atomic():
            chain_run(hold_steps(user_id=key.user_id, api_key=key, amount_ucents=amount))
            raise Undo
    except ChainMissed:
        return False
    except Undo:
        return True


def locked(key: ApiKey, amount: int) -> BillingError | None:
    """The locked path's refusal of the hold, or None when it places it (then undone)."""
    try:
        with transaction.atomic():
            hold_place(user=key.user, api_key=key, amount_ucents=amount)
            raise Undo
    except BillingError as refusal:
        return refusal
    except Undo:
        return None


class CreditLimitTests:
    @pytest.mark.parametrize("state", ACCOUNTS, ids=str)
    def test_its_sql_and_its_check_agree_with_the_rule(self, state: tuple[int, int]) -> None:
        account, _ = customer_with(account=state, key=(None, 0, 0))
        for amount in AMOUNTS:
            fits = credit_covers(*state, amount)
            assert (CREDIT.unmet(account, amount) is None, fits_by_sql(CREDIT, account.pk, amount)) == (fits, fits), (
                amount
            )

    def test_its_refusal_says_what_the_credit_leaves(self) -> None:
        account, _ = customer_with(account=(10 * USD, 4 * USD), key=(None, 0, 0))
        refusal = CREDIT.unmet(account, 7 * USD)
        assert isinstance(refusal, InsufficientCredit) and refusal.status == 402
        assert refusal.message == (
            "This request may cost up to $7.00 but the available credit is $6.00. Top up, or lower max_tokens."
        )

    def test_a_customer_in_debt_is_told_nothing_is_left(self) -> None:
        account, _ = customer_with(account=(-USD, 0), key=(None, 0, 0))
        assert "the available credit is $0.00." in CREDIT.unmet(account, 1).message


class KeyCapTests:
    @pytest.mark.parametrize("state", KEYS, ids=str)
    def test_its_sql_and_its_check_agree_with_the_rule(self, state: tuple[int | None, int, int]) -> None:
        _, key = customer_with(account=(10 * USD, 0), key=state)
        for amount in AMOUNTS:
            fits = cap_covers(*state, amount)
            assert (KEY_CAP.unmet(key, amount) is None, fits_by_sql(KEY_CAP, key.pk, amount)) == (fits, fits), amount

    def test_its_refusal_says_what_the_cap_leaves(self) -> None:
        _, key = customer_with(account=(100 * USD, 0), key=(10 * USD, 3 * USD, 2 * USD))
        refusal = KEY_CAP.unmet(key, 7 * USD)
        assert isinstance(refusal, KeyLimitExceeded) and refusal.status == 402
        assert refusal.message == (
            "This request may cost up to $7.00 but this API key's spend cap leaves $5.00. "
            "Raise the key's cap or use another key."
        )


class AdmissionPathTests:
    @pytest.mark.parametrize("account_state", ACCOUNTS, ids=str)
    @pytest.mark.parametrize("key_state", KEYS, ids=str)
    def test_the_chain_places_exactly_the_holds_the_locked_path_places(self, account_state, key_state) -> None:
        _, key = customer_with(account=account_state, key=key_state)
        for amount in AMOUNTS:
            refusal = locked(key, amount)
            assert chained(key, amount) is (refusal is None), amount
            if not credit_covers(*account_state, amount):
                assert isinstance(refusal, InsufficientCredit), amount  # the credit is named first
            elif not cap_covers(*key_state, amount):
                assert isinstance(refusal, KeyLimitExceeded), amount

    def test_a_key_with_a_counted_limit_takes_the_locked_path(self) -> None:
        """Even when the caller's copy of the key predates the limit: the chain's SQL checks the row."""
        _, stale = customer_with(account=(10 * USD, 0), key=(None, 0, 0))
        for limit in ({"max_concurrent": 3}, {"rate_limit_per_minute": 60}):
            ApiKey.objects.filter(pk=stale.pk).update(
                **{"max_concurrent": None, "rate_limit_per_minute": None, **limit}
            )
            assert hold_steps(user_id=stale.user_id, api_key=ApiKey.objects.get(pk=stale.pk), amount_ucents=1) is None
            assert not chained(stale, 1)
