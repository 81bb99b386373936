"""Reads of the ledger."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, TypedDict

from django.conf import settings
from django.db.models import Count, Min, Q, QuerySet, Sum
from django.utils import timezone

from billing.models import Account, Hold, LedgerEntry, LedgerTransaction, Payout, PayoutProfile, StripeEvent, TopUp
from catalog.money import UCENTS_PER_CENT

if TYPE_CHECKING:
    from django.contrib.auth.models import User
    from django_stubs_ext import WithAnnotations

    from accounts.models import ApiKey
    from hosts.models import Host


RATE_WINDOW = timedelta(seconds=60)  # `ApiKey.rate_limit_per_minute` counts admissions in a rolling minute


def rate_headers(*, key: ApiKey, now: datetime | None = None) -> dict[str, str]:
    """OpenAI's rate-limit headers for a key with a per-minute limit (none without one):
    the limit, what is left of it now, and when the next place frees (the oldest admission
    in the window leaves it), as OpenAI writes durations ("12s")."""
    if key.rate_limit_per_minute is None:
        return {}
    now = now or timezone.now()
    window = Hold.objects.filter(api_key=key, created_at__gte=now - RATE_WINDOW).aggregate(
        count=Count("id"), oldest=Min("created_at")
    )
    reset = (window["oldest"] + RATE_WINDOW - now).total_seconds() if window["oldest"] else 0.0
    return {
        "x-ratelimit-limit-requests": str(key.rate_limit_per_minute),
        "x-ratelimit-remaining-requests": str(max(key.rate_limit_per_minute - window["count"], 0)),
        "x-ratelimit-reset-requests": f"{max(math.ceil(reset), 0)}s",
    }


def customer_account(*, user: User) -> Account | None:
    return Account.objects.filter(kind=Account.Kind.CUSTOMER, user=user).first()


def host_account(*, host: Host) -> Account | None:
    return Account.objects.filter(kind=Account.Kind.HOST, host=host).first()


def _vesting_entries(*, account: Account, now: datetime) -> QuerySet[LedgerEntry]:
    """The earnings not yet vested: the settlements (audit releases, scorers' fees) credited within the
    last EARNINGS_VEST_SECONDS, since the host's last forfeit (which took everything unvested)."""
    since = now - timedelta(seconds=settings.EARNINGS_VEST_SECONDS)
    forfeited_at = (
        LedgerEntry.objects.filter(account=account, transaction__kind=LedgerTransaction.Kind.FORFEIT)
        .order_by("-transaction__created_at")
        .values_list("transaction__created_at", flat=True)
        .first()
    )
    if forfeited_at is not None and forfeited_at > since:
        since = forfeited_at
    return LedgerEntry.objects.filter(
        account=account,
        transaction__created_at__gt=since,
        transaction__kind__in=(
            LedgerTransaction.Kind.SETTLEMENT,
            LedgerTransaction.Kind.AUDIT_RELEASE,
            LedgerTransaction.Kind.AUDIT_SCORE,
        ),
        amount_ucents__gt=0,
    )


def payout_profile(*, host: Host) -> PayoutProfile | None:
    return PayoutProfile.objects.filter(host=host).first()


def host_unvested_ucents(*, account: Account, now: datetime | None = None) -> int:
    """Earnings not yet payable (never more than the account holds)."""
    recent = (
        _vesting_entries(account=account, now=now or timezone.now()).aggregate(total=Sum("amount_ucents"))["total"] or 0
    )
    return max(0, min(recent, account.available_ucents))


def host_vesting_schedule(*, account: Account, now: datetime | None = None) -> list[tuple[datetime, int]]:
    """When the unvested earnings become payable: (moment, µ¢) pairs, soonest first, that
    add up to `host_unvested_ucents`. When the account holds less than it earned recently,
    the soonest amounts are the ones left out (the answer never promises money early)."""
    now = now or timezone.now()
    vest = timedelta(seconds=settings.EARNINGS_VEST_SECONDS)
    schedule = [
        (credited_at + vest, amount)
        for credited_at, amount in _vesting_entries(account=account, now=now)
        .order_by("transaction__created_at", "pk")
        .values_list("transaction__created_at", "amount_ucents")
    ]
    excess = sum(amount for _, amount in schedule) - host_unvested_ucents(account=account, now=now)
    while excess > 0 and schedule:
        moment, amount = schedule.pop(0)
        if amount > excess:
            schedule.insert(0, (moment, amount - excess))
        excess -= amount
    return schedule


def host_payable_ucents(*, account: Account, now: datetime | None = None) -> int:
    """What the host may withdraw now: its earnings less what has not vested."""
    return max(0, account.available_ucents - host_unvested_ucents(account=account, now=now))


def ledger_total() -> int:
    """Sum of every entry ever written: zero in a healthy ledger."""
    return LedgerEntry.objects.aggregate(total=Sum("amount_ucents"))["total"] or 0


class _Total(TypedDict):
    total: int  # the sum of the transaction's entries


def unbalanced_transactions() -> list[WithAnnotations[LedgerTransaction, _Total]]:
    return list(LedgerTransaction.objects.annotate(total=Sum("entries__amount_ucents")).exclude(total=0))


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


def orphaned_holds() -> list[Hold]:
    """Active holds whose request already ended: credit reserved for nothing."""
    return list(
        Hold.objects.filter(status=Hold.Status.ACTIVE, request__status__in=["completed", "failed"])
        .select_related("request")
        .order_by("pk")
    )


def stripe_drift() -> list[str]:
    """Top-up credit in the ledger must equal the paid top-ups recorded by webhook events."""
    problems = []
    ledger = LedgerEntry.objects.filter(
        transaction__kind=LedgerTransaction.Kind.TOPUP, account__kind=Account.Kind.CUSTOMER
    ).aggregate(total=Sum("amount_ucents"), n=Count("pk"))
    credited = StripeEvent.objects.filter(outcome=StripeEvent.Outcome.CREDITED).aggregate(
        total=Sum("topup__amount_cents"), n=Count("pk")
    )
    ledger_total, credited_total = ledger["total"] or 0, (credited["total"] or 0) * UCENTS_PER_CENT
    if ledger_total != credited_total or ledger["n"] != credited["n"]:
        problems.append(
            f"Stripe: ledger credited {ledger_total} µ¢ in {ledger['n']} top-ups, "
            f"webhook events credited {credited_total} µ¢ in {credited['n']}"
        )
    for topup in TopUp.objects.filter(status=TopUp.Status.PAID).exclude(events__outcome=StripeEvent.Outcome.CREDITED):
        problems.append(f"{topup}: paid without a recorded crediting event")
    return problems


def payout_drift() -> list[str]:
    """The payouts-pending account must hold exactly the payouts not yet decided."""
    pending = (
        Account.objects.filter(kind=Account.Kind.PAYOUTS_PENDING).values_list("balance_ucents", flat=True).first() or 0
    )
    undecided = (
        Payout.objects.filter(status__in=[Payout.Status.REQUESTED, Payout.Status.SENDING]).aggregate(
            total=Sum("amount_ucents")
        )["total"]
        or 0
    )
    if pending != undecided:
        return [f"payouts pending: account holds {pending} µ¢, undecided payouts total {undecided} µ¢"]
    return []


def reconcile_report() -> list[str]:
    """Every problem the ledger replay finds; empty when the books are straight."""
    problems = [f"{txn}: entries sum to {txn.total}, not 0" for txn in unbalanced_transactions()]
    problems += cache_drift()
    problems += [
        f"hold {hold.pk}: still active ({hold.amount_ucents} µ¢) "
        f"but its request {hold.request.public_id} is {hold.request.status}"
        for hold in orphaned_holds()
    ]
    problems += stripe_drift()
    problems += payout_drift()
    return problems


@dataclass(frozen=True)
class HostPayouts:
    """A host's money side: its balance, what it may withdraw, and its payouts."""

    balance_ucents: int
    available_ucents: int  # payable now: vested earnings not yet withdrawn
    unvested_ucents: int  # earned, payable once EARNINGS_VEST_SECONDS have passed
    forfeited_ucents: int
    pending_payout_ucents: int
    paid_out_ucents: int
    payouts: list[Payout]


def host_payouts(*, host: Host, limit: int = 100) -> HostPayouts:
    account = host_account(host=host)
    payouts = Payout.objects.filter(host=host)
    sums = payouts.aggregate(
        pending=Sum("amount_ucents", filter=Q(status__in=[Payout.Status.REQUESTED, Payout.Status.SENDING])),
        paid=Sum("amount_ucents", filter=Q(status=Payout.Status.PAID)),
    )
    unvested = host_unvested_ucents(account=account) if account else 0
    forfeited = 0
    if account is not None:
        forfeited = -(
            LedgerEntry.objects.filter(account=account, transaction__kind=LedgerTransaction.Kind.FORFEIT).aggregate(
                total=Sum("amount_ucents")
            )["total"]
            or 0
        )
    return HostPayouts(
        balance_ucents=account.balance_ucents if account else 0,
        available_ucents=max(0, account.available_ucents - unvested) if account else 0,
        unvested_ucents=unvested,
        forfeited_ucents=forfeited,
        pending_payout_ucents=sums["pending"] or 0,
        paid_out_ucents=sums["paid"] or 0,
        payouts=list(payouts.order_by("-created_at", "-pk")[:limit]),
    )
