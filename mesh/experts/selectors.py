"""Reads for the expert market: targets, coverage, demand, recruitment, dispatch maps.

Freshness decides everything here: a coordinator report older than
`MOE_COORDINATOR_STALE_SECONDS` no longer counts, so a silent coordinator (or one that never
reported) is neither saturated nor wants any replica (nobody would dispatch to them), an
ACTIVE worker whose heartbeat is older than `MOE_WORKER_STALE_SECONDS` covers nothing, and an
ASSIGNED slice counts as covered for `MOE_ASSIGN_TTL_SECONDS` while its volunteer downloads it
(so two volunteers are not handed the same gap).

Volunteers need not be trusted (a pure volunteer serves no jobs, so it could never earn
trust): a host that is not trusted serves on *expert probation*, and the dispatch map asks
its model's coordinator to recompute `MOE_PROBATION_CHECK_SHARE` of its batches (instead of
the coordinator's usual few per cent) until the host's workers have passed
`MOE_PROBATION_CHECKS` of them (`probation_hosts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Q, QuerySet, Sum
from django.utils import timezone

from hosts.models import Host
from mesh.experts.models import ExpertModel, ExpertWorker


def seconds(name: str) -> timedelta:
    """A freshness window from settings (MOE_*_SECONDS), read per call so tests may override it."""
    return timedelta(seconds=getattr(settings, name))


@dataclass(frozen=True)
class SliceDemand:
    model: str
    layer: int
    first: int
    count: int
    covered: int
    target: int

    @property
    def missing(self) -> int:
        return self.target - self.covered


def coordinator_reporting(model: ExpertModel, *, now: datetime | None = None) -> bool:
    """Has the model's coordinator reported within `MOE_COORDINATOR_STALE_SECONDS`?"""
    now = now or timezone.now()
    return model.reported_at is not None and now - model.reported_at <= seconds("MOE_COORDINATOR_STALE_SECONDS")


def coordinator_state(model: ExpertModel, *, now: datetime | None = None) -> str:
    """ "reporting", "silent" (it reported once, not lately) or "never" (it has not reported yet)."""
    if coordinator_reporting(model, now=now):
        return "reporting"
    return "never" if model.reported_at is None else "silent"


def is_saturated(model: ExpertModel, *, now: datetime | None = None) -> bool:
    """Saturated per the coordinator's last report, if that report is fresh."""
    return model.saturated and coordinator_reporting(model, now=now)


def boost_held(model: ExpertModel, *, now: datetime | None = None) -> bool:
    """Is the boost held back because the coordinator does not use the workers it has? True
    from `MOE_UNUSED_GRACE_SECONDS` after it last started sending its measured workers only
    probes, until `MOE_UNUSED_RETRY_SECONDS` after that (then it is offered once more)."""
    since = model.remote_unused_since
    if since is None:
        return False
    waited = (now or timezone.now()) - since
    return seconds("MOE_UNUSED_GRACE_SECONDS") <= waited < seconds("MOE_UNUSED_RETRY_SECONDS")


def effective_target(model: ExpertModel, *, now: datetime | None = None) -> int:
    """Replicas each slice wants: none while the coordinator is not reporting (nobody would
    dispatch to them), the base while it is quiet, base + boost while it is saturated, unless
    the boost is held back because it does not use the workers it has (`boost_held`)."""
    if not coordinator_reporting(model, now=now):
        return 0
    boosted = is_saturated(model, now=now) and not boost_held(model, now=now)
    return model.base_target + (model.boost if boosted else 0)


def _live_q(now: datetime) -> Q:
    """Active and heartbeating, or just assigned, on a host that still accepts work (a host
    banned, in maintenance, e.g. after a failed canary, or paused by its owner covers nothing,
    so it is aged out and leaves the dispatch map)."""
    active = Q(status=ExpertWorker.Status.ACTIVE, heartbeat_at__gte=now - seconds("MOE_WORKER_STALE_SECONDS"))
    pending = Q(status=ExpertWorker.Status.ASSIGNED, assigned_at__gte=now - seconds("MOE_ASSIGN_TTL_SECONDS"))
    return (active | pending) & Q(host__in=Host.objects.accepting())


def covering_workers(model: ExpertModel, *, now: datetime | None = None) -> QuerySet[ExpertWorker]:
    """Workers that count as coverage now (`_live_q`)."""
    return ExpertWorker.objects.filter(_live_q(now or timezone.now()), model=model)


def live_worker_of_host(*, host: Host, now: datetime | None = None) -> ExpertWorker | None:
    """The slice this host serves now, if any (a host serves one at a time)."""
    return ExpertWorker.objects.select_related("model").filter(_live_q(now or timezone.now()), host=host).first()


def model_slices(model: ExpertModel) -> list[tuple[int, int, int]]:
    """Every (layer, first, count) slice, from the GGUF metadata recorded at registration."""
    return [
        (layer, first, min(model.slice_size, model.n_experts - first))
        for layer in range(model.n_layers)
        for first in range(0, model.n_experts, model.slice_size)
    ]


def slice_coverage(model: ExpertModel, *, now: datetime | None = None) -> list[SliceDemand]:
    """Each slice with how many workers cover it and how many it wants."""
    target = effective_target(model, now=now)
    counts: dict[tuple[int, int], int] = {}
    for layer, first, count in covering_workers(model, now=now).values_list("layer", "first", "count"):
        for start in range(first, first + count, model.slice_size):  # a worker may cover several slices
            counts[(layer, start)] = counts.get((layer, start), 0) + 1
    return [
        SliceDemand(model.name, layer, first, count, counts.get((layer, first), 0), target)
        for layer, first, count in model_slices(model)
    ]


def expert_demand(*, now: datetime | None = None) -> tuple[bool, list[SliceDemand]]:
    """(recruiting, scarce slices): scarce = covered below the effective target. Recruiting
    means a saturated model is asking for more than its base."""
    now = now or timezone.now()
    scarce: list[SliceDemand] = []
    recruiting = False
    for model in ExpertModel.objects.order_by("name"):
        wanted = [s for s in slice_coverage(model, now=now) if s.missing > 0]
        scarce += wanted
        recruiting |= bool(wanted) and is_saturated(model, now=now) and not boost_held(model, now=now)
    return recruiting, scarce


def recruitment(*, now: datetime | None = None) -> list[dict]:
    """Per model: busy, saturation, base vs effective target, and its workers."""
    now = now or timezone.now()
    rows = []
    for model in ExpertModel.objects.order_by("name").prefetch_related("workers"):
        rows.append(
            {
                "model": model.name,
                "busy": model.busy,
                "saturation_threshold": model.saturation_threshold,
                "saturated": is_saturated(model, now=now),
                "base_target": model.base_target,
                "boost": model.boost,
                "boost_held": boost_held(model, now=now),
                "effective_target": effective_target(model, now=now),
                "reported_at": model.reported_at,
                "coordinator": coordinator_state(model, now=now),
                "silent_since": model.silent_since,
                "n_layers": model.n_layers,
                "n_experts": model.n_experts,
                "slice_size": model.slice_size,
                "workers": _recruitment_workers(model),
            }
        )
    return rows


def _recruitment_workers(model: ExpertModel) -> list[dict]:
    """A model's workers that have not retired, each with whether its host is on probation."""
    workers = [w for w in model.workers.all() if w.status != ExpertWorker.Status.RETIRED]
    probation = probation_hosts({w.host_id for w in workers})
    return [
        {
            "id": w.pk,
            "host": w.host_id,
            "layer": w.layer,
            "first": w.first,
            "count": w.count,
            "status": w.status,
            "last_serve_ms": w.last_serve_ms,
            "heartbeat_at": w.heartbeat_at,
            "checks_passed": w.checks_passed,
            "probation": w.host_id in probation,
        }
        for w in workers
    ]


def probation_hosts(host_ids: set[int]) -> set[int]:
    """Those of `host_ids` on expert probation: not trusted, and their expert workers (all of
    them, ever) have passed fewer than `MOE_PROBATION_CHECKS` recomputed batches."""
    untrusted = set(
        Host.objects.filter(pk__in=host_ids).exclude(pk__in=Host.objects.trusted()).values_list("pk", flat=True)
    )
    passed = dict(
        ExpertWorker.objects.filter(host_id__in=untrusted)
        .values("host_id")
        .annotate(total=Sum("checks_passed"))
        .values_list("host_id", "total")
    )
    return {host_id for host_id in untrusted if (passed.get(host_id) or 0) < settings.MOE_PROBATION_CHECKS}


def excused_lately(model: ExpertModel, *, now: datetime | None = None) -> bool:
    """Was a failed audit of the coordinator excused within `MOE_EXCUSE_SECONDS`
    (`services.coordinator_failure_excuse`)?"""
    excused = model.excused_at
    return excused is not None and (now or timezone.now()) - excused < seconds("MOE_EXCUSE_SECONDS")


def dispatch_map(model: ExpertModel, *, now: datetime | None = None) -> list[dict]:
    """The coordinator's workers: active, heartbeating, with how to reach them, the secret
    each one admits the coordinator's link with (for the model's coordinator only) and the
    share of its batches to recompute (`check_share`: 1, every batch, for every worker while
    a failed audit of the coordinator stands excused; else the probation share for a host on
    probation, null for the coordinator's own)."""
    now = now or timezone.now()
    workers = list(covering_workers(model, now=now).filter(status=ExpertWorker.Status.ACTIVE).order_by("id"))
    probation = probation_hosts({w.host_id for w in workers})
    every = excused_lately(model, now=now)
    return [
        {
            "id": w.pk,
            "layer": w.layer,
            "first": w.first,
            "count": w.count,
            "address": w.address,
            "relay": not w.address,
            "last_serve_ms": w.last_serve_ms,
            "secret": w.secret,
            "check_share": 1.0 if every else settings.MOE_PROBATION_CHECK_SHARE if w.host_id in probation else None,
        }
        for w in workers
    ]


def coordinates(*, host_id: int, model_name: str) -> bool:
    """Whether `host_id` is the coordinator the operator bound to the MoE model `model_name`:
    its answers are the expert mesh's, drawn from the engine's logits, and audited as any
    host's."""
    return ExpertModel.objects.filter(name=model_name, coordinator_id=host_id).exists()


def worker_of_host(*, worker_id: int, host_id: int) -> ExpertWorker | None:
    return ExpertWorker.objects.select_related("model").filter(pk=worker_id, host_id=host_id).first()


def relay_worker_allowed(*, worker_id: int, host_id: int) -> bool:
    """May this host hold the relay socket of this worker? Its own, not retired."""
    return (
        ExpertWorker.objects.filter(pk=worker_id, host_id=host_id).exclude(status=ExpertWorker.Status.RETIRED).exists()
    )


def relay_coordinator_allowed(*, worker_id: int, host_id: int) -> bool:
    """May this host send work to this worker through the relay? The coordinator of its model."""
    return (
        ExpertWorker.objects.filter(pk=worker_id, model__coordinator_id=host_id)
        .exclude(status=ExpertWorker.Status.RETIRED)
        .exists()
    )
