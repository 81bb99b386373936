"""Reads for the web pages. Every customer or host read takes the signed-in
user and filters by it, so one person's page can never list another's rows."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, date, timedelta
from typing import TYPE_CHECKING, Any, TypedDict

from django.conf import settings
from django.db.models import Count, Max, OuterRef, Q, QuerySet, Subquery, Sum
from django.db.models.functions import Coalesce, TruncDate
from django.utils import timezone

from accounts.models import ApiKey
from billing.models import Account, TopUp
from billing.selectors import customer_account
from catalog.models import CatalogModel
from catalog.money import UCENTS_PER_CENT
from core.dates import day_bounds
from hosts.models import Host, Qualification
from hosts.selectors import warm_host_counts
from hosts.services import owner_may_resume
from marketplace.lifecycle.canaries import canary_summary
from marketplace.models import CanaryCheck, Job, Request, StageShare
from marketplace.selectors import host_status, with_running_job
from marketplace.trust.audits import audit_summary
from marketplace.trust.redundancy import warming_hosts

if TYPE_CHECKING:
    from django.contrib.auth.models import User
    from django_stubs_ext import WithAnnotations


@dataclass(frozen=True)
class Balance:
    balance_ucents: int
    held_ucents: int

    @property
    def available_ucents(self) -> int:
        return self.balance_ucents - self.held_ucents


def customer_balance(*, user: User) -> Balance:
    """The customer's credit and the part of it held by requests in flight (zero before the first grant)."""
    account = customer_account(user=user)
    if account is None:
        return Balance(balance_ucents=0, held_ucents=0)
    return Balance(balance_ucents=account.balance_ucents, held_ucents=account.held_ucents)


def api_keys_of(*, user: User) -> QuerySet[ApiKey]:
    """The user's keys, live ones first, newest first."""
    return ApiKey.objects.filter(user=user).order_by("revoked_at", "-created_at", "-pk")


def api_key_of(*, user: User, key_id: int) -> ApiKey | None:
    return ApiKey.objects.filter(user=user, pk=key_id).first()


def recent_requests(*, user: User, limit: int | None = None) -> list[Mapping[str, Any]]:
    """The user's latest requests (newest first) with what the usage table shows."""
    return list(
        Request.objects.filter(user=user)
        .order_by("-created_at", "-pk")
        .values(
            "public_id",
            "created_at",
            "status",
            "resumed",
            "model__name",
            "api_key__prefix",
            "prompt_tokens",
            "cached_tokens",
            "completion_tokens",
            "cost_ucents",
            "error_code",
        )[: limit or settings.WEB_RECENT_REQUESTS]
    )


def usage_breakdown(*, user: User, start: date, end: date, by: str) -> list[dict]:
    """The user's requests created from `start` to `end` (UTC days) split by "model" or "key":
    per group its requests, tokens in and out, and cost, the costliest first."""
    group = {"model": ["model__name"], "key": ["api_key_id", "api_key__prefix", "api_key__name"]}[by]
    lower, upper = day_bounds(start, end)
    rows = (
        Request.objects.filter(user=user, created_at__gte=lower, created_at__lt=upper)
        .values(*group)
        .annotate(
            requests=Count("pk"),
            prompt_tokens=Sum("prompt_tokens"),
            completion_tokens=Sum("completion_tokens"),
            cost_ucents=Sum("cost_ucents"),
        )
        .order_by("-cost_ucents", *group)
    )
    return [
        {
            **row,
            "prompt_tokens": row["prompt_tokens"] or 0,
            "completion_tokens": row["completion_tokens"] or 0,
            "cost_ucents": row["cost_ucents"] or 0,
        }
        for row in rows
    ]


TOPUPS_LISTED = 50


def topups_of(*, user: User, limit: int = TOPUPS_LISTED) -> list[dict]:
    """The user's top-ups, newest first, amounts in µ¢ (Stripe counts cents; the site shows µ¢
    through one formatter): what was asked, and what refunds and lost disputes took back."""
    rows = (
        TopUp.objects.filter(user=user)
        .order_by("-created_at", "-pk")
        .values("created_at", "paid_at", "status", "amount_cents", "refunded_cents", "disputed_cents")[:limit]
    )
    return [
        {
            "created_at": row["created_at"],
            "paid_at": row["paid_at"],
            "status": row["status"],
            "amount_ucents": row["amount_cents"] * UCENTS_PER_CENT,
            "taken_back_ucents": (row["refunded_cents"] + row["disputed_cents"]) * UCENTS_PER_CENT,
        }
        for row in rows
    ]


def days_between(start: date, end: date) -> list[date]:
    return [start + timedelta(days=n) for n in range((end - start).days + 1)]


def host_earnings_daily(*, host: Host, start: date, end: date) -> list[dict]:
    """Per UTC day from `start` to `end` (every day, zeros included): jobs finished and µ¢ earned."""
    lower, upper = day_bounds(start, end)
    rows = (
        Job.objects.filter(host=host, status=Job.Status.COMPLETED, finished_at__gte=lower, finished_at__lt=upper)
        .annotate(day=TruncDate("finished_at", tzinfo=UTC))
        .values("day")
        .annotate(jobs=Count("pk"), earned_ucents=Sum("earned_ucents"))
    )
    stages = (  # a ring stage's shares of the jobs it ran layers of
        StageShare.objects.filter(host=host, finished_at__gte=lower, finished_at__lt=upper)
        .annotate(day=TruncDate("finished_at", tzinfo=UTC))
        .values("day")
        .annotate(jobs=Count("pk"), earned_ucents=Sum("earned_ucents"))
    )
    totals: dict[date, dict[str, int]] = {}
    for row in [*rows, *stages]:
        day = totals.setdefault(row["day"], {"jobs": 0, "earned_ucents": 0})
        day["jobs"] += row["jobs"]
        day["earned_ucents"] += row["earned_ucents"] or 0
    return [{"day": day, **totals.get(day, {"jobs": 0, "earned_ucents": 0})} for day in days_between(start, end)]


class _Running(TypedDict):
    running_jobs: int


def hosts_of(*, user: User) -> list[WithAnnotations[Host, _Running]]:
    """The user's hosts, each with `running_jobs` (its jobs running now, of its `slots`)."""
    running = Job.objects.filter(host=OuterRef("pk"), status=Job.Status.RUNNING).order_by().values("host")
    counted = running.annotate(n=Count("pk")).values("n")
    return list(
        with_running_job(Host.objects.filter(owner=user))
        .annotate(running_jobs=Coalesce(Subquery(counted), 0))
        .order_by("name", "pk")
    )


def host_of(*, user: User, host_id: int) -> Host | None:
    """The host if `user` owns it; None for anyone else (the page answers 404, not 403, so ids leak nothing)."""
    return Host.objects.filter(owner=user, pk=host_id).first()


# Who set a maintenance, as its owner reads it (`Host.maintenance_by`); others are shown as stored.
MAINTENANCE_BY = {
    "operator": "the operator",
    "verification": "verification (an answer to a hidden test did not match the real model)",
    "automatic": "the reliability rule (too many jobs dropped or failed)",
}


def maintenance_setter(host: Host) -> str:
    return MAINTENANCE_BY.get(host.maintenance_by, host.maintenance_by or "unknown")


def owner_status(host: Host) -> str:
    """The status an owner reads: banned before anything else (a banned host may still look
    connected until its heartbeats time out), then `marketplace.selectors.host_status`."""
    return "banned" if host.banned_at is not None else host_status(host=host)


def host_statuses(*, user: User) -> list[dict]:
    """What the machines page polls: each of the user's hosts and its status right now, with
    who set its maintenance and whether the owner may lift it."""
    return [
        {
            "id": host.pk,
            "name": host.name,
            "status": owner_status(host),
            "jobs": f"{host.running_jobs} of {host.claim_cap}",  # (running now, of the jobs it may take at once)
            "maintenance_reason": host.maintenance_reason or None,
            "maintenance_by": maintenance_setter(host) if host.maintenance_since else None,
            "may_resume": owner_may_resume(host),
            "ban_reason": host.ban_reason if host.banned_at else None,
            "last_heartbeat_at": host.last_heartbeat_at.isoformat() if host.last_heartbeat_at else None,
        }
        for host in hosts_of(user=user)
    ]


def qualifications_of(*, host: Host) -> QuerySet[Qualification]:
    return host.qualifications.select_related("model").order_by("model__name", "-updated_at")


def catalog_models() -> QuerySet[CatalogModel]:
    return CatalogModel.objects.filter(active=True).order_by("name")


def quickstart_model(*, kind: str) -> CatalogModel | None:
    """The model a snippet of this kind names: of the active models of `kind`, the one the
    most online hosts serve now (a snippet run now is answered), then by name; None if the
    catalog sells none of that kind."""
    models = list(catalog_models().filter(kind=kind))
    counts = warm_host_counts()
    return min(models, key=lambda model: (-counts.get(model.pk, {}).get("online", 0), model.name), default=None)


POOL_MAINTENANCE_LISTED = 50  # also the banned and failed-verification lists


@dataclass(frozen=True)
class ModelWarmth:
    """For one model: online hosts that qualified it, and those of them warm for it
    (`hosts.selectors.warm_host_counts`)."""

    name: str
    qualified_online: int
    warm: int


@dataclass(frozen=True)
class PoolOverview:
    hosts_total: int
    hosts_online: int
    hosts_busy: int
    hosts_paused: int
    hosts_maintenance: int
    jobs_queued: int
    jobs_running: int
    failures_last_hour: int
    continuations_last_hour: int
    requests_failed_last_hour: int
    requests_completed_last_hour: int
    models: list[ModelWarmth]
    in_maintenance: list[Host]
    hosts_probation: int
    hosts_trusted: int
    hosts_banned: int
    canaries: dict  # `marketplace.lifecycle.canaries.canary_summary`
    audits: dict  # `marketplace.trust.audits.audit_summary`: by status, and the models that cannot be audited here
    banned: list[Host]
    failed_verification: list[dict]
    warming: list[dict]  # `marketplace.trust.redundancy.warming_hosts`: asked to keep a latency-critical model warm
    versions: list[tuple[str, int]]  # mahout versions of the connected hosts, most used first
    customers_owing: int  # customers whose balance a refund or chargeback took below zero
    owed_ucents: int


def _model_warmth() -> list[ModelWarmth]:
    """Per active model, routing's count of online hosts that qualified it and of those warm for it."""
    counts = warm_host_counts()
    return [
        ModelWarmth(
            name=name, qualified_online=counts.get(pk, {}).get("online", 0), warm=counts.get(pk, {}).get("warm", 0)
        )
        for pk, name in catalog_models().values_list("pk", "name")
    ]


def pool_overview() -> PoolOverview:
    """The operator's view of the pool: who is connected, what is waiting, what went wrong in the last hour.

    Statuses follow `marketplace.selectors.host_status`: a connected host in maintenance
    counts as neither online nor paused; `hosts_maintenance` counts every host in
    maintenance, connected or not.
    """
    now = timezone.now()
    hour_ago = now - timedelta(hours=1)
    alive = Host.objects.connected(now)
    available = alive.filter(maintenance_since__isnull=True)
    online = Host.objects.online(now)
    busy_ids = set(Job.objects.filter(status=Job.Status.RUNNING, host__in=alive).values_list("host_id", flat=True))
    jobs = Job.objects.aggregate(
        queued=Count("pk", filter=Q(status=Job.Status.QUEUED)),
        running=Count("pk", filter=Q(status=Job.Status.RUNNING)),
        failures=Count("pk", filter=Q(status=Job.Status.FAILED, finished_at__gte=hour_ago)),
        continuations=Count("pk", filter=Q(attempt__gt=1, created_at__gte=hour_ago)),
    )
    requests = Request.objects.filter(finished_at__gte=hour_ago).aggregate(
        failed=Count("pk", filter=Q(status=Request.Status.FAILED)),
        completed=Count("pk", filter=Q(status=Request.Status.COMPLETED)),
    )
    maintenance = Host.objects.filter(maintenance_since__isnull=False)
    return PoolOverview(
        hosts_total=Host.objects.count(),
        hosts_online=online.count(),
        hosts_busy=len(busy_ids),
        hosts_paused=available.filter(paused=True).count(),
        hosts_maintenance=maintenance.count(),
        jobs_queued=jobs["queued"],
        jobs_running=jobs["running"],
        failures_last_hour=jobs["failures"],
        continuations_last_hour=jobs["continuations"],
        requests_failed_last_hour=requests["failed"],
        requests_completed_last_hour=requests["completed"],
        models=_model_warmth(),
        in_maintenance=list(
            maintenance.select_related("owner").order_by("maintenance_since", "pk")[:POOL_MAINTENANCE_LISTED]
        ),
        **_trust_counts(),
        canaries=canary_summary(),
        audits=audit_summary(),
        banned=list(
            Host.objects.filter(banned_at__isnull=False)
            .select_related("owner")
            .order_by("-banned_at", "-pk")[:POOL_MAINTENANCE_LISTED]
        ),
        failed_verification=verification_failures(),
        warming=warming_hosts(now=now),
        versions=[
            (row["version"] or "unknown", row["n"])
            for row in alive.values("version").annotate(n=Count("pk")).order_by("-n", "version")
        ],
        **_debts(),
    )


def _debts() -> dict[str, int]:
    owing = Account.objects.filter(kind=Account.Kind.CUSTOMER, balance_ucents__lt=0).aggregate(
        n=Count("pk"), total=Sum("balance_ucents")
    )
    return {"customers_owing": owing["n"] or 0, "owed_ucents": -(owing["total"] or 0)}


def _trust_counts() -> dict[str, int]:
    """Hosts trusted (`Host.objects.trusted`, the one rule), banned, and in probation (the
    rest: neither trusted nor banned)."""
    trusted, banned = Host.objects.trusted().count(), Host.objects.filter(banned_at__isnull=False).count()
    return {
        "hosts_probation": Host.objects.count() - trusted - banned,
        "hosts_trusted": trusted,
        "hosts_banned": banned,
    }


def verification_failures(*, limit: int = POOL_MAINTENANCE_LISTED) -> list[dict]:
    """Hosts that failed a canary, latest failure first: how many times, when last and why,
    and whether they are banned or held in maintenance now (what the operator decides on)."""
    failed = CanaryCheck.objects.filter(verdict=CanaryCheck.Verdict.FAILED)
    latest = failed.filter(host=OuterRef("host")).order_by("-decided_at", "-pk")
    rows = (
        failed.values("host_id", "host__name", "host__owner__username", "host__banned_at", "host__maintenance_since")
        .annotate(failures=Count("pk"), last_at=Max("decided_at"), last_reason=Subquery(latest.values("reason")[:1]))
        .order_by("-last_at", "-host_id")[:limit]
    )
    return [dict(row) for row in rows]
