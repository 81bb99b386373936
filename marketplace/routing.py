"""Model-aware routing: which waiting host gets which job (hosts still pull).

A host is **warm** for a model when its last catalog says the model is loaded. A
host whose catalog is missing, stale or unreadable is **possibly warm** for every
model it qualified, so routing never does worse than first-come-first-served.

When a job is queued, `route_offer` picks one warm host with a free slot by the
model's strategy and offers the job to it for `ROUTING_OFFER_SECONDS`; until then
only that host may claim it. After that any warm host may. Hosts that are not warm
(they would have to load the model) may claim it only after
`ROUTING_COLD_GRACE_SECONDS`: the last resort. The claim query applies these rules
(`claim_sql`), so every decision is a row in the database, not a process's memory.

Strategies within the warm set:
- `least-connections`: the host with the fewest running jobs plus live offers;
- `weighted`: the host furthest below its share, share ∝ weight (the operator's
  `Host.routing_weight`, else its measured tokens/s for the model), counted over
  the jobs routed in the last `ROUTING_WEIGHT_WINDOW_SECONDS`.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection
from django.db.models import Count, Max, Q
from django.utils import timezone

from hosts.models import Host, Qualification
from marketplace.models import CatalogModel, Job

LEAST_CONNECTIONS = "least-connections"
WEIGHTED = "weighted"


def strategy_for(model: CatalogModel) -> str:
    return model.routing_strategy or settings.ROUTING_STRATEGY


def catalog_fresh(host: Host, now: datetime) -> bool:
    """Whether the host's catalog can be trusted to say what is loaded."""
    return host.catalog_at is not None and now - host.catalog_at <= timedelta(seconds=settings.CATALOG_STALE_SECONDS)


def warm_model_ids(*, host: Host, model_ids: list[int], now: datetime | None = None) -> list[int]:
    """Of `model_ids` (the host's qualified models), those it may take during the cold grace."""
    now = now or timezone.now()
    if not catalog_fresh(host, now):
        return list(model_ids)
    loaded = set(host.catalog.get("loaded") or [])
    names = dict(CatalogModel.objects.filter(pk__in=model_ids).values_list("pk", "name"))
    return [model_id for model_id in model_ids if names.get(model_id) in loaded]


def claim_sql(*, host_id: int, model_ids: list[int], warm_ids: list[int], now: datetime) -> tuple[str, list]:
    """The jobs this host may claim now, best first, as SQL conditions and an ORDER BY (with
    their parameters): queued, of a model it qualified; not offered to someone else (or
    the offer lapsed); warm here or past the cold grace; not a continuation within its
    grace of the host that died; jobs offered to this host first, then oldest first.
    Plain SQL because it runs on every claim (see `services.job_claim_selected`)."""
    adapt = connection.ops.adapt_datetimefield_value
    at, grace_over = adapt(now), adapt(now - timedelta(seconds=settings.CONTINUATION_GRACE_SECONDS))
    models_in = ", ".join(["%s"] * len(model_ids))
    warm_in = f"model_id IN ({', '.join(['%s'] * len(warm_ids))})" if warm_ids else "1 = 0"
    sql = (
        f"status = %s AND model_id IN ({models_in})"
        " AND (avoid_host_id IS NULL OR avoid_host_id <> %s OR created_at < %s)"
        " AND (offered_host_id IS NULL OR offered_host_id = %s OR offer_until < %s)"
        f" AND (warm_until IS NULL OR warm_until < %s OR {warm_in})"
        " ORDER BY CASE WHEN offered_host_id = %s THEN 0 ELSE 1 END, created_at, id"
    )
    params = [Job.Status.QUEUED, *model_ids, host_id, grace_over, host_id, at, at, *warm_ids, host_id]
    return sql, params


@dataclass
class Candidate:
    host_id: int
    active: int
    slots: int
    weight: float
    routed: int = 0


def candidates(*, model: CatalogModel, now: datetime) -> list[Candidate]:
    """Online, unpaused hosts out of maintenance, qualified for the model and warm
    (or possibly warm), each with its load. Three queries whatever the pool size."""
    online_since = now - timedelta(seconds=settings.HOST_OFFLINE_AFTER_SECONDS)
    hosts = list(
        Host.objects.filter(
            qualifications__model=model, paused=False, maintenance_since__isnull=True, last_heartbeat_at__gte=online_since
        )
        .annotate(best_tps=Max("qualifications__gen_tps", filter=Q(qualifications__model=model)))
        .only("pk", "catalog", "catalog_at", "slots", "routing_weight")
    )
    warm = [host for host in hosts if not catalog_fresh(host, now) or model.name in (host.catalog.get("loaded") or [])]
    if not warm:
        return []
    ids = [host.pk for host in warm]
    load: dict[int, int] = dict.fromkeys(ids, 0)
    busy = Job.objects.filter(
        Q(status=Job.Status.RUNNING, host_id__in=ids) | Q(status=Job.Status.QUEUED, offered_host_id__in=ids, offer_until__gte=now)
    ).values_list("status", "host_id", "offered_host_id")
    for status, host_id, offered_id in busy:
        holder = host_id if status == Job.Status.RUNNING else offered_id
        load[holder] = load.get(holder, 0) + 1
    return [
        Candidate(
            host_id=host.pk, active=load[host.pk], slots=host.slots,
            weight=host.routing_weight if host.routing_weight is not None else (host.best_tps or 1.0),
        )
        for host in warm
    ]


def pick(*, model: CatalogModel, pool: list[Candidate], now: datetime) -> Candidate | None:
    """The strategy's choice among hosts with a free slot, or None when all are full."""
    free = [c for c in pool if c.active < c.slots]
    if not free:
        return None
    if strategy_for(model) == WEIGHTED:
        since = now - timedelta(seconds=settings.ROUTING_WEIGHT_WINDOW_SECONDS)
        routed = dict(
            Job.objects.filter(model=model, offered_host_id__in=[c.host_id for c in free], created_at__gte=since)
            .values("offered_host_id")
            .annotate(n=Count("id"))
            .values_list("offered_host_id", "n")
        )
        for c in free:
            c.routed = routed.get(c.host_id, 0)
        positive = [c for c in free if c.weight > 0] or free
        return min(positive, key=lambda c: ((c.routed + 1) / max(c.weight, 1e-9), c.active, random.random()))
    return min(free, key=lambda c: (c.active, random.random()))


def route_offer(*, job: Job, model: CatalogModel) -> int | None:
    """Decide a new job's placement; returns the host it is offered to, if any.

    Writes the offer and the cold grace onto the job row (the caller's transaction).
    """
    now = timezone.now()
    pool = [c for c in candidates(model=model, now=now) if c.host_id != job.avoid_host_id]  # never the host that died
    chosen = pick(model=model, pool=pool, now=now)
    job.warm_until = now + timedelta(seconds=settings.ROUTING_COLD_GRACE_SECONDS)
    job.offered_host_id = chosen.host_id if chosen else None
    job.offer_until = now + timedelta(seconds=settings.ROUTING_OFFER_SECONDS) if chosen else None
    Job.objects.filter(pk=job.pk).update(
        warm_until=job.warm_until, offered_host_id=job.offered_host_id, offer_until=job.offer_until
    )
    return job.offered_host_id


def warm_host_counts(*, now: datetime | None = None) -> dict[int, dict[str, int]]:
    """Per catalog model id: hosts online (qualified, unpaused, not in maintenance) and
    how many of them are warm (or possibly warm)."""
    now = now or timezone.now()
    online_since = now - timedelta(seconds=settings.HOST_OFFLINE_AFTER_SECONDS)
    rows = Qualification.objects.filter(
        host__paused=False, host__maintenance_since__isnull=True, host__last_heartbeat_at__gte=online_since, model__active=True
    ).values_list("model_id", "model__name", "host_id", "host__catalog", "host__catalog_at").distinct()
    counts: dict[int, dict[str, int]] = {}
    seen: set[tuple[int, int]] = set()
    for model_id, name, host_id, catalog, catalog_at in rows:
        if (model_id, host_id) in seen:
            continue
        seen.add((model_id, host_id))
        entry = counts.setdefault(model_id, {"online": 0, "warm": 0})
        entry["online"] += 1
        fresh = catalog_at is not None and now - catalog_at <= timedelta(seconds=settings.CATALOG_STALE_SECONDS)
        if not fresh or name in ((catalog or {}).get("loaded") or []):
            entry["warm"] += 1
    return counts


REDUNDANT_WARM_HOSTS = 2  # a latency-critical model's failover stays warm only with a second warm host


def under_redundant_models(*, counts: dict[int, dict[str, int]] | None = None) -> list[tuple[CatalogModel, int]]:
    """Latency-critical models with fewer than two warm hosts, with their warm count."""
    counts = warm_host_counts() if counts is None else counts
    return [
        (model, counts.get(model.pk, {}).get("warm", 0))
        for model in CatalogModel.objects.filter(latency_critical=True, active=True).order_by("name")
        if counts.get(model.pk, {}).get("warm", 0) < REDUNDANT_WARM_HOSTS
    ]
