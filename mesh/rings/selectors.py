"""Reads for ring plans."""
from __future__ import annotations

from django.db.models import Q, QuerySet

from hosts.models import Host
from mesh.rings.models import RingPlan, RingStage


def stage_runner_q(host: Host) -> Q:
    """The stages `host` runs: its own, and the host-less stages of the rings it bridges."""
    return Q(host=host) | Q(host__isnull=True, plan__bridge_host=host)


def ring_assignments(*, host: Host) -> QuerySet[RingStage]:
    """The stages of active plans this host must run, with their plans: its own stages, and
    the host-less stages of the rings it bridges."""
    return (
        RingStage.objects.filter(stage_runner_q(host), plan__status=RingPlan.Status.ACTIVE)
        .select_related("plan", "plan__model")
        .prefetch_related("plan__stages")
        .order_by("plan_id", "index")
    )


def ring_for_participant(*, plan_id: int, host: Host) -> RingPlan | None:
    """The plan, if this host bridges it or serves one of its stages."""
    return (
        RingPlan.objects.filter(Q(bridge_host=host) | Q(stages__host=host), pk=plan_id)
        .select_related("model")
        .distinct()
        .first()
    )


def stage_shares(stage: RingStage) -> dict:
    """A stage's reported time use; `hold_share` near 1 means saturated, near 0 starved."""
    busy = stage.hold_s + stage.idle_s
    return {
        "stage": stage.index, "start": stage.start, "end": stage.end, "host": stage.host_id,
        "hold_s": stage.hold_s, "idle_s": stage.idle_s, "queue_depth": stage.queue_depth, "batches": stage.batches,
        "hold_share": round(stage.hold_s / busy, 4) if busy else None, "reported_at": stage.reported_at,
    }


def stage_address(stage: RingStage) -> dict:
    """Where a stage listens, as it last reported ("" until it has)."""
    return {
        "stage": stage.index, "start": stage.start, "end": stage.end, "host": stage.host_id,
        "address": stage.address, "reported_at": stage.address_reported_at,
    }


def bridged_model_ids(*, host_id: int) -> list[int]:
    """The models this host serves through a ring it bridges (active plans): it scores no
    audit of them (a bridge holds no whole model to read one with)."""
    return sorted(set(RingPlan.objects.filter(bridge_host_id=host_id, status=RingPlan.Status.ACTIVE)
                      .values_list("model_id", flat=True)))


def ring_layers(*, bridge_host_id: int, model_id: int) -> tuple[RingPlan, dict[int, int]] | None:
    """The ring this host serves `model_id` through, if it bridges an active one, and the
    layers each of its hosts runs (a host-less stage is the bridge's): what a ring's tokens
    are paid by. None for a host serving the model on its own machine."""
    plan = (
        RingPlan.objects.filter(bridge_host_id=bridge_host_id, model_id=model_id, status=RingPlan.Status.ACTIVE)
        .order_by("-created_at", "-pk").first()
    )
    if plan is None:
        return None
    layers: dict[int, int] = {bridge_host_id: 0}
    for host_id, start, end in plan.stages.values_list("host_id", "start", "end"):
        runner = host_id if host_id is not None else bridge_host_id
        layers[runner] = layers.get(runner, 0) + end - start
    return plan, layers


def relay_stage_allowed(*, plan_id: int, index: int, host_id: int) -> bool:
    """May this host hold the relay socket of stage `index`? It runs that stage of an active ring."""
    host = Host(pk=host_id)
    return RingStage.objects.filter(
        stage_runner_q(host), plan_id=plan_id, index=index, plan__status=RingPlan.Status.ACTIVE
    ).exists()


def relay_dial_allowed(*, plan_id: int, index: int, host_id: int) -> bool:
    """May this host dial stage `index` through the relay? It takes part in the active ring
    (a stage host dials its next stage, the bridge the head and the tail)."""
    plan = ring_for_participant(plan_id=plan_id, host=Host(pk=host_id))
    return plan is not None and plan.status == RingPlan.Status.ACTIVE and plan.stages.filter(index=index).exists()
