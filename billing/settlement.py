"""Settling a request: the one host-share rule (`split_cost`, a ring's `split_by_layers`) and
`hold_settle`, which charges a hold's actual cost exactly once and pays the hosts and the
platform (or the audit escrow) their shares."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Q
from django.utils import timezone

from accounts.models import ApiKey
from billing.ledger import account_for_host, system_account
from billing.models import Account, Hold, LedgerEntry, LedgerTransaction
from hosts.models import Host


@dataclass(frozen=True)
class Settlement:
    cost_ucents: int
    host_ucents: int
    platform_ucents: int


def split_cost(cost_ucents: int) -> Settlement:
    """The host gets floor(80%); the platform keeps the remainder, so no µ¢ is lost.
    The one place the host's share is computed (a continuation's host too)."""
    host = cost_ucents * settings.HOST_SHARE_PERCENT // 100
    return Settlement(cost_ucents=cost_ucents, host_ucents=host, platform_ucents=cost_ucents - host)


def split_by_layers(host_ucents: int, layers: Mapping[int, int]) -> dict[int, int]:
    """A ring's host share among its hosts (host id → layers it ran): floor(share × layers /
    all layers) each; what the floors leave is the platform's (so no µ¢ is invented)."""
    total = sum(layers.values())
    if total <= 0:
        raise ValueError("a ring runs at least one layer")
    return {host_id: host_ucents * count // total for host_id, count in layers.items()}


@transaction.atomic(savepoint=False)  # always inside the caller's transaction; one fewer round trip pair
def hold_settle(
    *,
    hold: Hold,
    cost_ucents: int,
    host: Host | None,
    reference: str,
    host_ucents: int | None = None,
    others: Mapping[int, int] | None = None,
    memo: str = "",
    escrow: bool = False,
) -> Settlement | None:
    """Charge the actual cost against a hold, exactly once.

    The host earns `host_ucents` (default floor(80%) of the cost; never more);
    with no host (nobody finished the work) the platform keeps everything.
    `others` (host id → µ¢: a ring's stage hosts, `split_by_layers`) are paid out
    of the same share: `host_ucents` and theirs together never exceed it, and the
    platform keeps the rest. Returns None when the hold was already settled or
    released (someone else got there first). The cost can never exceed what was held.
    With `escrow`, the hosts' shares go to the audit escrow instead, a ring's stage
    hosts' with its bridge's (`audit_release` pays each once its job's audit passes,
    `audit_refund` gives them back to the customer if it fails).

    Hot rows (the customer's account, their key, the platform account) are
    updated last, one statement each and in the global lock order (account,
    key, hosts by account, platform), so their row locks are held only until the
    commit that follows: that is what lets one busy customer settle hundreds of
    requests a second.
    """
    if not 0 <= cost_ucents <= hold.amount_ucents:
        raise ValueError(f"cost {cost_ucents} outside the hold of {hold.amount_ucents}")
    others = {host_id: amount for host_id, amount in (others or {}).items() if host is None or host_id != host.pk}
    ceiling = split_cost(cost_ucents).host_ucents
    own = 0 if host is None else ceiling if host_ucents is None else host_ucents
    if own < 0 or any(amount < 0 for amount in others.values()) or own + sum(others.values()) > ceiling:
        raise ValueError(
            f"host shares {own} and {sorted(others.values())} above {settings.HOST_SHARE_PERCENT}% of {cost_ucents}"
        )
    split = Settlement(
        cost_ucents=cost_ucents, host_ucents=own, platform_ucents=cost_ucents - own - sum(others.values())
    )
    payees = {**({} if host is None else {host.pk: own}), **others}
    platform_id, accounts = _settlement_account_ids(host_ids=list(payees))
    if escrow and host is not None:
        accounts = dict.fromkeys(accounts, system_account(Account.Kind.AUDIT_ESCROW).pk)
    legs: dict[int, int] = {}
    for host_id, amount in payees.items():  # (escrowed, a ring's shares are one leg)
        legs[accounts[host_id]] = legs.get(accounts[host_id], 0) + amount
    host_legs = sorted(legs.items())
    if not _settlement_write(
        hold=hold, split=split, reference=reference, platform_id=platform_id, host_legs=host_legs, memo=memo
    ):
        return None
    return split


def _settlement_account_ids(*, host_ids: list[int]) -> tuple[int, dict[int, int]]:
    """The platform's and the hosts' account ids in one SELECT (each created the first time)."""
    wanted = Q(kind=Account.Kind.PLATFORM)
    if host_ids:
        wanted |= Q(kind=Account.Kind.HOST, host_id__in=host_ids)
    platform_id, accounts = None, {}
    for pk, kind, host_id in Account.objects.filter(wanted).values_list("pk", "kind", "host_id"):
        if kind == Account.Kind.PLATFORM:
            platform_id = pk
        else:
            accounts[host_id] = pk
    for missing in set(host_ids) - set(accounts):
        accounts[missing] = account_for_host(host=Host.objects.get(pk=missing)).pk
    return platform_id or system_account(Account.Kind.PLATFORM).pk, accounts


def _settlement_write(
    *,
    hold: Hold,
    split: Settlement,
    reference: str,
    platform_id: int,
    host_legs: list[tuple[int, int]],
    memo: str = "",
) -> bool:
    """The settlement's writes as plain SQL, one statement per row (the ORM's statement
    building costs more than the database's work here, and this runs for every request).

    The hold's compare-and-set decides; then the transaction and its entries; the hot
    rows (customer account, key, host, platform) last, in the global lock order.
    """
    table = {
        model: connection.ops.quote_name(model._meta.db_table)
        for model in (Hold, LedgerTransaction, LedgerEntry, Account, ApiKey)
    }
    now = connection.ops.adapt_datetimefield_value(timezone.now())
    legs = [(hold.account_id, -split.cost_ucents), (platform_id, split.platform_ucents), *host_legs]
    legs = [(account_id, amount) for account_id, amount in legs if amount]
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {table[Hold]} SET status = %s, closed_at = %s WHERE id = %s AND status = %s",
            [Hold.Status.SETTLED, now, hold.pk, Hold.Status.ACTIVE],
        )
        if cursor.rowcount != 1:
            return False
        cursor.execute(
            (
                f"INSERT INTO {table[LedgerTransaction]} (kind, reference, memo, created_at)"
                " VALUES (%s, %s, %s, %s) RETURNING id"
            ),
            [LedgerTransaction.Kind.SETTLEMENT, reference, memo, now],
        )
        transaction_id = cursor.fetchone()[0]
        if legs:
            rows = ", ".join(["(%s, %s, %s)"] * len(legs))
            cursor.execute(
                f"INSERT INTO {table[LedgerEntry]} (transaction_id, account_id, amount_ucents) VALUES {rows}",
                [value for account_id, amount in legs for value in (transaction_id, account_id, amount)],
            )
        cursor.execute(
            (
                f"UPDATE {table[Account]} SET balance_ucents = balance_ucents - %s, held_ucents = held_ucents - %s"
                " WHERE id = %s"
            ),
            [split.cost_ucents, hold.amount_ucents, hold.account_id],
        )
        cursor.execute(
            (
                f"UPDATE {table[ApiKey]} SET held_ucents = held_ucents - %s, spent_ucents = spent_ucents + %s"
                " WHERE id = %s"
            ),
            [hold.amount_ucents, split.cost_ucents, hold.api_key_id],
        )
        for account_id, amount in (*host_legs, (platform_id, split.platform_ucents)):
            if amount:
                cursor.execute(
                    f"UPDATE {table[Account]} SET balance_ucents = balance_ucents + %s WHERE id = %s",
                    [amount, account_id],
                )
    return True
