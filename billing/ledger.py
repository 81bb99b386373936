"""The ledger's own writes: the accounts (each created the first time it is needed) and
`ledger_post`, the one way a balanced transaction is appended; grants of credit from outside."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from django.db import IntegrityError, transaction
from django.db.models import F

from billing.errors import InvalidAmount
from billing.models import Account, LedgerEntry, LedgerTransaction
from hosts.models import Host

if TYPE_CHECKING:
    from django.contrib.auth.models import User


def account_for_customer(*, user: User) -> Account:
    return _get_or_create_account(kind=Account.Kind.CUSTOMER, user=user)


def account_for_host(*, host: Host) -> Account:
    return _get_or_create_account(kind=Account.Kind.HOST, host=host)


def system_account(kind: str) -> Account:
    return _get_or_create_account(kind=kind)


def _get_or_create_account(**lookup: Any) -> Account:
    """One SELECT on the hot path; the savepoint and insert only the first time."""
    account = Account.objects.filter(**lookup).first()
    if account is not None:
        return account
    try:
        with transaction.atomic():
            account, _ = Account.objects.get_or_create(**lookup)
            return account
    except IntegrityError:  # created concurrently by someone else: theirs is as good
        return Account.objects.get(**lookup)


def ledger_post(*, kind: str, reference: str, memo: str, legs: list[tuple[Account, int]]) -> LedgerTransaction:
    """Append one balanced transaction and its entries, and move the cached balances with it."""
    if sum(amount for _, amount in legs) != 0:
        raise ValueError(f"unbalanced transaction {kind}:{reference}: {legs}")
    txn = LedgerTransaction.objects.create(kind=kind, reference=reference, memo=memo)
    LedgerEntry.objects.bulk_create(
        [
            LedgerEntry(transaction=txn, account_id=account.pk, amount_ucents=amount)
            for account, amount in legs
            if amount
        ]
    )
    for account, amount in legs:
        if amount:
            Account.objects.filter(pk=account.pk).update(balance_ucents=F("balance_ucents") + amount)
    return txn


@transaction.atomic
def credit_grant(*, user: User, amount_ucents: int, reference: str, memo: str = "") -> LedgerTransaction:
    """Give a customer credit from outside money (operator grant or demo seed)."""
    if amount_ucents <= 0:
        raise ValueError("a grant must be a positive amount")
    customer = account_for_customer(user=user)
    funding = system_account(Account.Kind.FUNDING)
    return ledger_post(
        kind=LedgerTransaction.Kind.GRANT,
        reference=reference,
        memo=memo,
        legs=[(funding, -amount_ucents), (customer, amount_ucents)],
    )


def credit_grant_by_operator(*, user: User, amount_ucents: int, reason: str, operator: User) -> LedgerTransaction:
    """An operator's grant from the admin: a GRANT transaction with the reason and who gave it."""
    if not reason.strip():
        raise InvalidAmount("A grant needs a reason.")
    return credit_grant(
        user=user,
        amount_ucents=amount_ucents,
        reference=f"admin-{uuid.uuid4()}",
        memo=f"{reason.strip()} (by {operator})"[:255],
    )
