"""Reads of the ledger."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta

from django.db.models import Count, Q, Sum
from django.db.models.functions import TruncDate

from billing.models import UCENTS_PER_CENT, Account, Hold, LedgerEntry, LedgerTransaction, Payout, StripeEvent, TopUp


def customer_account(*, user) -> Account | None:  # type: ignore[no-untyped-def]
    return Account.objects.filter(kind=Account.Kind.CUSTOMER, user=user).first()


def host_account(*, host) -> Account | None:  # type: ignore[no-untyped-def]
    return Account.objects.filter(kind=Account.Kind.HOST, host=host).first()


def ledger_total() -> int:
    """Sum of every entry ever written: zero in a healthy ledger."""
    return LedgerEntry.objects.aggregate(total=Sum("amount_ucents"))["total"] or 0


def unbalanced_transactions() -> list[LedgerTransaction]:
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
    pending = Account.objects.filter(kind=Account.Kind.PAYOUTS_PENDING).values_list("balance_ucents", flat=True).first() or 0
    undecided = Payout.objects.filter(status__in=[Payout.Status.REQUESTED, Payout.Status.SENDING]).aggregate(
        total=Sum("amount_ucents")
    )["total"] or 0
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


# --- statements and usage ------------------------------------------------------------


@dataclass(frozen=True)
class HostStatement:
    balance_ucents: int
    available_ucents: int
    pending_payout_ucents: int
    paid_out_ucents: int
    jobs: list
    payouts: list[Payout]


def host_statement(*, host, limit: int = 100) -> HostStatement:  # type: ignore[no-untyped-def]
    """A host's earnings: balance, payouts and its completed jobs (never who asked)."""
    from marketplace.models import Job

    account = host_account(host=host)
    payouts = Payout.objects.filter(host=host)
    sums = payouts.aggregate(
        pending=Sum("amount_ucents", filter=Q(status__in=[Payout.Status.REQUESTED, Payout.Status.SENDING])),
        paid=Sum("amount_ucents", filter=Q(status=Payout.Status.PAID)),
    )
    jobs = (
        Job.objects.filter(host=host, status=Job.Status.COMPLETED)
        .order_by("-finished_at", "-pk")
        .values("pk", "model__name", "completion_tokens", "earned_ucents", "finished_at")[:limit]
    )
    return HostStatement(
        balance_ucents=account.balance_ucents if account else 0,
        available_ucents=account.available_ucents if account else 0,
        pending_payout_ucents=sums["pending"] or 0,
        paid_out_ucents=sums["paid"] or 0,
        jobs=list(jobs),
        payouts=list(payouts.order_by("-created_at", "-pk")[:limit]),
    )


def _day_bounds(start: date, end: date) -> tuple[datetime, datetime]:
    return (
        datetime.combine(start, time.min, tzinfo=UTC),
        datetime.combine(end + timedelta(days=1), time.min, tzinfo=UTC),
    )


class UnknownCursor(LookupError):
    """An `after` cursor that names none of this user's requests."""


def usage_requests(*, user, start: date, end: date, after: str | None = None):  # type: ignore[no-untyped-def]
    """The user's requests created from `start` to `end` inclusive (UTC days), oldest first;
    with `after` (a request id of theirs), only those that come after it in that order."""
    from marketplace.models import Request

    lower, upper = _day_bounds(start, end)
    rows = Request.objects.filter(user=user, created_at__gte=lower, created_at__lt=upper)
    if after:
        cursor = Request.objects.filter(user=user, public_id=after).values("created_at", "pk").first()
        if cursor is None:
            raise UnknownCursor(after)
        rows = rows.filter(Q(created_at__gt=cursor["created_at"]) | Q(created_at=cursor["created_at"], pk__gt=cursor["pk"]))
    return (
        rows.order_by("created_at", "pk")
        .values(
            "public_id", "created_at", "status", "model__name", "api_key__prefix",
            "prompt_tokens", "completion_tokens", "cost_ucents",
        )
    )


def usage_daily(*, user, start: date, end: date) -> list[dict]:  # type: ignore[no-untyped-def]
    """Per UTC day: requests, tokens and cost (failed requests cost 0)."""
    from marketplace.models import Request

    lower, upper = _day_bounds(start, end)
    rows = (
        Request.objects.filter(user=user, created_at__gte=lower, created_at__lt=upper)
        .annotate(day=TruncDate("created_at", tzinfo=UTC))
        .values("day")
        .annotate(
            requests=Count("pk"),
            prompt_tokens=Sum("prompt_tokens"),
            completion_tokens=Sum("completion_tokens"),
            cost_ucents=Sum("cost_ucents"),
        )
        .order_by("day")
    )
    return list(rows)
