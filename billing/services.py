"""Writes to the ledger. Every function runs in (or opens) one transaction and
takes row locks in a fixed order — customer account, then API key — so
concurrent admissions and settlements serialise instead of overspending."""
from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from billing.errors import InsufficientCredit, KeyLimitExceeded
from billing.models import Account, Hold, LedgerTransaction

UCENTS_PER_USD = 100_000_000


def usd_to_ucents(usd: str | float | int) -> int:
    """Exact conversion of a decimal USD amount (as typed by a person) to µ¢."""
    from decimal import Decimal, InvalidOperation

    try:
        value = Decimal(str(usd)) * UCENTS_PER_USD
    except InvalidOperation:
        raise ValueError(f"{usd!r} is not an amount in USD") from None
    if value != value.to_integral_value():
        raise ValueError(f"{usd!r} has more precision than a micro-cent")
    return int(value)


def account_for_customer(*, user) -> Account:  # type: ignore[no-untyped-def]
    return _get_or_create_account(kind=Account.Kind.CUSTOMER, user=user)


def account_for_host(*, host) -> Account:  # type: ignore[no-untyped-def]
    return _get_or_create_account(kind=Account.Kind.HOST, host=host)


def system_account(kind: str) -> Account:
    return _get_or_create_account(kind=kind)


def _get_or_create_account(**lookup: object) -> Account:
    try:
        with transaction.atomic():
            account, _ = Account.objects.get_or_create(**lookup)
            return account
    except IntegrityError:  # created concurrently by someone else: theirs is as good
        return Account.objects.get(**lookup)


def _post(*, kind: str, reference: str, memo: str, legs: list[tuple[Account, int]]) -> LedgerTransaction:
    """Append one balanced transaction and move the cached balances with it."""
    if sum(amount for _, amount in legs) != 0:
        raise ValueError(f"unbalanced transaction {kind}:{reference}: {legs}")
    txn = LedgerTransaction.objects.create(kind=kind, reference=reference, memo=memo)
    for account, amount in legs:
        if amount == 0:
            continue
        txn.entries.create(account=account, amount_ucents=amount)
        Account.objects.filter(pk=account.pk).update(balance_ucents=F("balance_ucents") + amount)
    return txn


@transaction.atomic
def credit_grant(*, user, amount_ucents: int, reference: str, memo: str = "") -> LedgerTransaction:  # type: ignore[no-untyped-def]
    """Give a customer credit from outside money (operator grant or demo seed)."""
    if amount_ucents <= 0:
        raise ValueError("a grant must be a positive amount")
    customer = account_for_customer(user=user)
    funding = system_account(Account.Kind.FUNDING)
    return _post(
        kind=LedgerTransaction.Kind.GRANT,
        reference=reference,
        memo=memo,
        legs=[(funding, -amount_ucents), (customer, amount_ucents)],
    )


def hold_place(*, user, api_key, amount_ucents: int) -> Hold:  # type: ignore[no-untyped-def]
    """Reserve `amount_ucents` against the balance and the key's cap, or refuse.

    Must run inside the caller's transaction (the request row is created in the
    same one). Locks the account, then the key.
    """
    from marketplace.models import ApiKey

    account = account_for_customer(user=user)
    account = Account.objects.select_for_update().get(pk=account.pk)
    key = ApiKey.objects.select_for_update().get(pk=api_key.pk)
    if account.available_ucents < amount_ucents:
        raise InsufficientCredit(
            f"This request may cost up to {format_usd(amount_ucents)} but the available credit is "
            f"{format_usd(max(account.available_ucents, 0))}. Top up, or lower max_tokens."
        )
    if key.spend_cap_ucents is not None and key.spent_ucents + key.held_ucents + amount_ucents > key.spend_cap_ucents:
        left = key.spend_cap_ucents - key.spent_ucents - key.held_ucents
        raise KeyLimitExceeded(
            f"This request may cost up to {format_usd(amount_ucents)} but this API key's spend cap leaves "
            f"{format_usd(max(left, 0))}. Raise the key's cap or use another key."
        )
    Account.objects.filter(pk=account.pk).update(held_ucents=F("held_ucents") + amount_ucents)
    ApiKey.objects.filter(pk=key.pk).update(held_ucents=F("held_ucents") + amount_ucents)
    return Hold.objects.create(account=account, api_key=key, amount_ucents=amount_ucents)


def _hold_close(*, hold: Hold, status: str) -> bool:
    """Compare-and-set a hold from active to `status`; False if already closed."""
    from marketplace.models import ApiKey

    closed = Hold.objects.filter(pk=hold.pk, status=Hold.Status.ACTIVE).update(status=status, closed_at=timezone.now())
    if not closed:
        return False
    Account.objects.filter(pk=hold.account_id).update(held_ucents=F("held_ucents") - hold.amount_ucents)
    ApiKey.objects.filter(pk=hold.api_key_id).update(held_ucents=F("held_ucents") - hold.amount_ucents)
    return True


@transaction.atomic
def hold_release(*, hold: Hold) -> bool:
    """Give the reserved credit back (request failed or expired). Idempotent."""
    return _hold_close(hold=hold, status=Hold.Status.RELEASED)


@dataclass(frozen=True)
class Settlement:
    cost_ucents: int
    host_ucents: int
    platform_ucents: int


def split_cost(cost_ucents: int) -> Settlement:
    """The host gets floor(80%); the platform keeps the remainder, so no µ¢ is lost."""
    host = cost_ucents * settings.HOST_SHARE_PERCENT // 100
    return Settlement(cost_ucents=cost_ucents, host_ucents=host, platform_ucents=cost_ucents - host)


@transaction.atomic
def hold_settle(*, hold: Hold, cost_ucents: int, host, reference: str) -> Settlement | None:  # type: ignore[no-untyped-def]
    """Charge the actual cost against a hold, exactly once.

    Returns None when the hold was already settled or released (someone else
    got there first). The cost can never exceed what was held.
    """
    from marketplace.models import ApiKey

    if not 0 <= cost_ucents <= hold.amount_ucents:
        raise ValueError(f"cost {cost_ucents} outside the hold of {hold.amount_ucents}")
    if not _hold_close(hold=hold, status=Hold.Status.SETTLED):
        return None
    split = split_cost(cost_ucents)
    _post(
        kind=LedgerTransaction.Kind.SETTLEMENT,
        reference=reference,
        memo="",
        legs=[
            (hold.account, -split.cost_ucents),
            (account_for_host(host=host), split.host_ucents),
            (system_account(Account.Kind.PLATFORM), split.platform_ucents),
        ],
    )
    ApiKey.objects.filter(pk=hold.api_key_id).update(spent_ucents=F("spent_ucents") + cost_ucents)
    return split


def format_usd(ucents: int) -> str:
    return f"${ucents / UCENTS_PER_USD:,.6f}"
