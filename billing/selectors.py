"""Reads of the ledger."""
from __future__ import annotations

from django.db.models import Sum

from billing.models import Account, Hold, LedgerEntry, LedgerTransaction


def customer_account(*, user) -> Account | None:  # type: ignore[no-untyped-def]
    return Account.objects.filter(kind=Account.Kind.CUSTOMER, user=user).first()


def host_account(*, host) -> Account | None:  # type: ignore[no-untyped-def]
    return Account.objects.filter(kind=Account.Kind.HOST, host=host).first()


def ledger_total() -> int:
    """Sum of every entry ever written: zero in a healthy ledger."""
    return LedgerEntry.objects.aggregate(total=Sum("amount_ucents"))["total"] or 0


def unbalanced_transactions() -> list[LedgerTransaction]:
    return [
        txn
        for txn in LedgerTransaction.objects.annotate(total=Sum("entries__amount_ucents")).exclude(total=0)
    ]


def cache_drift() -> list[str]:
    """Accounts whose cached balance or hold total differs from the replay."""
    problems = []
    for account in Account.objects.all():
        replay = account.entries.aggregate(total=Sum("amount_ucents"))["total"] or 0
        held = account.holds.filter(status=Hold.Status.ACTIVE).aggregate(total=Sum("amount_ucents"))["total"] or 0
        if replay != account.balance_ucents:
            problems.append(f"{account}: cached balance {account.balance_ucents} != ledger {replay}")
        if held != account.held_ucents:
            problems.append(f"{account}: cached holds {account.held_ucents} != active holds {held}")
    return problems
