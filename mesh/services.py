"""Writes for ring plans: creating a valid plan, recording what stages report."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from django.db import transaction
from django.utils import timezone

from hosts.models import Host
from marketplace.models import CatalogModel
from mesh.models import ModelLayout, RingPlan, RingStage


class PlanInvalid(ValueError):
    """A plan that cannot serve its model; the message says why."""


class NotAParticipant(PermissionError):
    """A host reported for a ring (or a stage) it does not serve."""


class NotYourStage(PermissionError):
    """A host reported for a stage of a ring it serves, but not that stage."""


@dataclass(frozen=True)
class StageSpec:
    start: int
    end: int
    host: Host | None = None


def plan_check(*, n_layers: int, stages: Sequence[StageSpec], row_width: int, micro_batch: int) -> None:
    """Raise `PlanInvalid` unless the stages cover [0, n_layers) exactly once, in order."""
    if len(stages) < 2:
        raise PlanInvalid("a pipeline needs at least two stages")
    if row_width <= 0:
        raise PlanInvalid(f"row width must be positive, not {row_width}")
    if micro_batch <= 0:
        raise PlanInvalid(f"micro-batch must be positive, not {micro_batch}")
    expected = 0
    for index, stage in enumerate(stages):
        if stage.start >= stage.end:
            raise PlanInvalid(f"stage {index} has an empty range [{stage.start}, {stage.end})")
        if stage.end > n_layers:
            raise PlanInvalid(f"stage {index} [{stage.start}, {stage.end}) runs past the model's {n_layers} layers")
        if stage.start > expected:
            raise PlanInvalid(f"layers [{expected}, {stage.start}) are in no stage (a gap before stage {index})")
        if stage.start < expected:
            raise PlanInvalid(f"stage {index} [{stage.start}, {stage.end}) overlaps layers before {expected}")
        expected = stage.end
    if expected != n_layers:
        raise PlanInvalid(f"layers [{expected}, {n_layers}) are in no stage (the last stage ends early)")


@transaction.atomic
def ring_plan_create(
    *, model_name: str, stages: Sequence[StageSpec], row_width: int, micro_batch: int, bridge_host: Host | None = None,
) -> RingPlan:
    """Validate and store a plan; refuses one stage, gaps, overlaps, ranges past the model, widths <= 0."""
    model = CatalogModel.objects.filter(name=model_name).first()
    if model is None:
        raise PlanInvalid(f"unknown model {model_name!r}")
    layout = ModelLayout.objects.filter(model=model).first()
    if layout is None:
        raise PlanInvalid(f"the layer count of {model_name!r} is not known; record its layout first")
    plan_check(n_layers=layout.n_layers, stages=stages, row_width=row_width, micro_batch=micro_batch)
    plan = RingPlan.objects.create(
        model=model, n_layers=layout.n_layers, row_width=row_width, micro_batch=micro_batch, bridge_host=bridge_host
    )
    RingStage.objects.bulk_create(
        RingStage(plan=plan, index=i, start=s.start, end=s.end, host=s.host) for i, s in enumerate(stages)
    )
    return plan


@transaction.atomic
def ring_stats_report(*, plan_id: int, host: Host, stages: Sequence[dict]) -> int:
    """Record each reported stage's hold/idle seconds and queue depth.

    The plan's bridge host may report every stage (it collects them around the ring); a
    stage host only its own. Returns the number of stages updated.
    """
    plan = RingPlan.objects.select_for_update().filter(pk=plan_id).first()
    if plan is None:
        raise NotAParticipant(f"no ring {plan_id}")
    rows = RingStage.objects.filter(plan=plan)
    if plan.bridge_host_id != host.pk:
        rows = rows.filter(host=host)
    if not rows.exists():
        raise NotAParticipant(f"host {host.pk} serves no stage of ring {plan_id}")
    now, updated = timezone.now(), 0
    for report in stages:
        changed = rows.filter(index=report["stage"]).update(
            hold_s=report["hold_s"], idle_s=report["idle_s"], queue_depth=report["queue_depth"],
            batches=report.get("batches", 0), reported_at=now,
        )
        if not changed:  # the whole report is refused (the transaction rolls back)
            raise NotYourStage(f"host {host.pk} does not serve stage {report['stage']} of ring {plan_id}")
        updated += changed
    return updated
