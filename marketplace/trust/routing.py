"""Model-aware routing: which waiting host gets which job (hosts still pull).

A host is **warm** for a model when its last catalog says the model is loaded. A
host whose catalog is missing, stale or unreadable is **possibly warm** for every
model it qualified, so routing never does worse than first-come-first-served.

When a job is queued, `placement` picks one warm host with a free slot by the
model's strategy and offers the job to it for `ROUTING_OFFER_SECONDS`; until then
only that host may claim it. After that any warm host may. Hosts that are not warm
(they would have to load the model) are the last resort: they may claim it at once when no
warm host is online, after `ROUTING_COLD_GRACE_SECONDS` when a free warm host was offered it,
and otherwise only once the soonest busy warm host was expected to be free
(`cold_wait_seconds`). The claim query applies these rules
(`claim_sql`), so every decision is a row in the database, not a process's memory.

Strategies within the warm set, after reputation (`marketplace.trust.reputation`): trusted
hosts before hosts in probation, honest reports before overstated ones:
- `least-connections`: the host whose slots are least taken by running jobs plus live
  offers (a share of its slots: a host serving 8 streams at once with 2 running is less
  busy than a one-slot host with 1), then the fewest;
- `weighted`: the host furthest below its share, share ∝ weight (the operator's
  `Host.routing_weight`, else the tokens/s the gateway measured on its jobs; a host
  not measured yet counts its report, bounded), counted over the jobs routed in the
  last `ROUTING_WEIGHT_WINDOW_SECONDS`.
Before the strategy, each while it has a free slot: an `n` request's later choice goes to the host
its first went to, and a prompt whose prefix a warm host holds (`marketplace.trust.prefixes`) to
the one holding the longest.
A host is offered a job only below its claim cap (slots, bounded by reputation); a job
for trusted hosts only is offered to, and claimed by, trusted hosts alone.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, TypedDict, cast

from django.conf import settings
from django.db import connection
from django.db.models import Count
from django.utils import timezone

from catalog.models import CatalogModel
from hosts.models import TRUSTED, Host, Qualification, online_rule
from marketplace.models import Job
from marketplace.trust import reputation

if TYPE_CHECKING:
    from django.db.models.query import RawQuerySet
    from django_stubs_ext import WithAnnotations

LEAST_CONNECTIONS = "least-connections"
WEIGHTED = "weighted"


def strategy_for(model: CatalogModel) -> str:
    return model.routing_strategy or settings.ROUTING_STRATEGY


def claim_sql(
    *,
    host_id: int,
    model_ids: list[int],
    warm_ids: list[int],
    now: datetime,
) -> tuple[str, list]:
    """The jobs this host may claim now, best first, as SQL conditions and an ORDER BY (with
    their parameters): queued, of a model it qualified; not offered to someone else (or
    the offer lapsed); warm here or past the cold grace; not a continuation within its
    grace of the host that died; not a canary meant for another host; jobs offered to this
    host first, then oldest first.
    Plain SQL because it runs on every claim (see `services.job_claim_selected`)."""
    adapt = connection.ops.adapt_datetimefield_value
    at, grace_over = adapt(now), adapt(now - timedelta(seconds=settings.CONTINUATION_GRACE_SECONDS))
    models_in = ", ".join(["%s"] * len(model_ids))
    warm_in = f"model_id IN ({', '.join(['%s'] * len(warm_ids))})" if warm_ids else "1 = 0"
    sql = (
        f"status = %s AND model_id IN ({models_in})"
        " AND (avoid_host_id IS NULL OR avoid_host_id <> %s OR created_at < %s)"
        " AND (only_host_id IS NULL OR only_host_id = %s)"
        " AND (offered_host_id IS NULL OR offered_host_id = %s OR offer_until < %s)"
        f" AND (warm_until IS NULL OR warm_until < %s OR {warm_in})"
        " ORDER BY CASE WHEN offered_host_id = %s THEN 0 ELSE 1 END, created_at, id"
    )
    params = [Job.Status.QUEUED, *model_ids, host_id, grace_over, host_id, host_id, at, at, *warm_ids, host_id]
    return sql, params


@dataclass
class Candidate:
    host_id: int
    active: int
    slots: int  # its claim cap: slots bounded by reputation
    weight: float
    speed: float = 1.0  # tokens/s routing believes (`reputation.routing_speed`)
    trusted: bool = False
    overstated: bool = False
    routed: int = 0

    @property
    def rank(self) -> tuple[bool, bool]:
        """Reputation first: trusted before probation, honest reports before overstated."""
        return (not self.trusted, self.overstated)


class _Load(TypedDict):
    """The columns `candidates` reads beside a host's own."""

    best_tps: float | None
    active: int


def candidates(
    *,
    model: CatalogModel,
    now: datetime,
    trusted_only: bool = False,
    passed_over: frozenset[int | None] = frozenset(),
) -> list[Candidate]:
    """Online hosts (`Host.objects.online`; trusted ones alone when `trusted_only`), qualified
    for the model and warm (or possibly warm), but for those `passed_over`, each with its load
    (running jobs and live offers) and its claim cap (`Host.claim_cap`). One plain
    statement whatever the pool size (a raw queryset: the fields' own converters read it back):
    it runs on every admission, where the ORM's statement building cost several times the query."""
    quote = connection.ops.quote_name
    host_table, qualification_table, job_table = (quote(m._meta.db_table) for m in (Host, Qualification, Job))
    hosts, hosts_params = (online_rule(now) + TRUSTED if trusted_only else online_rule(now)).sql(alias="h")
    at = connection.ops.adapt_datetimefield_value(now)
    # Each host's load is read through the (host, status) and (offered_host, status) indexes:
    # its jobs running or offered now, never its history of jobs.
    sql = (
        "SELECT h.id, h.catalog, h.catalog_at, h.slots, h.routing_weight, h.trusted_at, h.banned_at, h.measured_tps,"
        f" (SELECT MAX(q.gen_tps) FROM {qualification_table} q WHERE q.host_id = h.id AND q.model_id = %s) AS best_tps,"
        f" (SELECT COUNT(*) FROM {job_table} j WHERE j.host_id = h.id AND j.status = %s)"
        f" + (SELECT COUNT(*) FROM {job_table} j WHERE j.offered_host_id = h.id AND j.status = %s"
        " AND j.offer_until >= %s) AS active"
        f" FROM {host_table} h WHERE {hosts}"
        f" AND EXISTS (SELECT 1 FROM {qualification_table} q WHERE q.host_id = h.id AND q.model_id = %s)"
    )
    params = [model.pk, Job.Status.RUNNING, Job.Status.QUEUED, at, *hosts_params, model.pk]
    found = []
    rows = cast("RawQuerySet[WithAnnotations[Host, _Load]]", Host.objects.raw(sql, params))
    for host in rows:
        if host.pk in passed_over or not host.warm_for(model.name, now):
            continue
        speed = reputation.routing_speed(reported_tps=host.best_tps, measured_tps=host.measured_tps)
        found.append(
            Candidate(
                host_id=host.pk,
                active=host.active,
                slots=host.claim_cap,
                weight=host.routing_weight if host.routing_weight is not None else speed,
                speed=speed,
                trusted=host.is_trusted,
                overstated=reputation.overstated(reported_tps=host.best_tps, measured_tps=host.measured_tps),
            )
        )
    return found


def pick(*, model: CatalogModel, pool: list[Candidate], now: datetime) -> Candidate | None:
    """The strategy's choice among hosts with a free slot, or None when all are full."""
    free = [c for c in pool if c.active < c.slots]
    if not free:
        return None
    best = min(c.rank for c in free)
    free = [c for c in free if c.rank == best]
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
    return min(free, key=lambda c: (c.active / c.slots, c.active, random.random()))  # the least busy share of its slots


def placement(
    *,
    model: CatalogModel,
    avoid_host_id: int | None = None,
    trusted_only: bool = False,
    beside_host_id: int | None = None,
    prefix_hosts: Mapping[int, int] | None = None,
) -> dict:
    """A new job's placement, as the job row's fields: the host it is offered to (if any)
    and until when, and how long cold hosts wait (`cold_wait_seconds`). The host whose
    attempt died is never offered it. `beside_host_id` (the host given a job this one shares
    its prompt with: an `n` request's first choice) is offered it while it has a free slot,
    before the strategy's choice: a host serving several sequences reads the shared prompt once.
    Then `prefix_hosts` (hosts holding a prefix of its prompt, with its tokens:
    `marketplace.trust.prefixes`): the one holding the longest is offered it while it has a free
    slot, however busy (`longest_prefix`)."""
    now = timezone.now()
    pool = candidates(model=model, now=now, trusted_only=trusted_only, passed_over=frozenset({avoid_host_id}))
    beside = next((c for c in pool if c.host_id == beside_host_id and c.active < c.slots), None)
    chosen = beside or longest_prefix(pool, prefix_hosts or {}) or pick(model=model, pool=pool, now=now)
    wait = cold_wait_seconds(pool=pool, offered=chosen is not None, now=now)
    return {
        "warm_until": None if wait is None else now + timedelta(seconds=wait),
        "offered_host_id": chosen.host_id if chosen else None,
        "offer_until": now + timedelta(seconds=settings.ROUTING_OFFER_SECONDS) if chosen else None,
    }


def longest_prefix(pool: list[Candidate], prefix_hosts: Mapping[int, int]) -> Candidate | None:
    """Of the hosts with a free slot, the one holding the longest prefix of the prompt (the least
    busy share of its slots among equals), or None. A prefix outweighs load and reputation: a
    free slot on the host that holds it skips the prefill another host would compute, and it
    was already chosen for the turn it holds. A busy holder is passed over, never waited for."""
    holding = [c for c in pool if prefix_hosts.get(c.host_id, 0) > 0 and c.active < c.slots]
    if not holding:
        return None
    return max(holding, key=lambda c: (prefix_hosts[c.host_id], -c.active / c.slots, -c.active))


def cold_wait_seconds(*, pool: list[Candidate], offered: bool, now: datetime) -> float | None:
    """How long a job is for warm hosts only before a cold host (one that must load the model)
    may take it: cold is the last resort (seed 002), not a fixed delay.

    None when no warm host is online (nothing warm will ever start it: a cold host may take it
    at once); the grace (ROUTING_COLD_GRACE_SECONDS) when a warm host with a free slot was
    offered it; otherwise until the soonest busy warm host is expected to free a slot — each
    running job's `max_tokens` left at the speed routing believes of its host — plus the
    grace, at most ROUTING_COLD_MAX_WAIT_SECONDS."""
    if not pool:
        return None
    grace = settings.ROUTING_COLD_GRACE_SECONDS
    if offered:
        return grace
    speeds = {c.host_id: max(c.speed, 1e-3) for c in pool}
    running = Job.objects.filter(status=Job.Status.RUNNING, host_id__in=list(speeds)).values_list(
        "host_id", "first_token_at", "request__params"
    )
    soonest = None
    for host_id, first_token_at, params in running:
        left = int((params or {}).get("max_tokens") or 0) / speeds[host_id]
        if first_token_at is not None:
            left -= (now - first_token_at).total_seconds()
        soonest = max(left, 0.0) if soonest is None else min(soonest, max(left, 0.0))
    return min((soonest or 0.0) + grace, settings.ROUTING_COLD_MAX_WAIT_SECONDS)
