"""Reads for ring plans, and the secrets of a ring's links (`stage_links`, `bridge_links`)."""

from __future__ import annotations

import hashlib
import hmac

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


def link_secret(plan: RingPlan, *, upstream: int | None, downstream: int) -> str:
    """The secret of one link of a ring: from stage `upstream` (None: the bridge) to stage
    `downstream`. Derived from the plan's own secret, which never leaves the gateway, and
    bound to the link's two ends: whoever holds it holds no other link's (`mahout.ring.keys`)."""
    sender = "bridge" if upstream is None else f"stage-{upstream}"
    label = f"elephant-ring-link|{plan.pk}|{sender}->stage-{downstream}"
    return hmac.new(plan.secret.encode(), label.encode(), hashlib.sha256).hexdigest()


def stage_links(stage: RingStage, n_stages: int) -> dict:
    """The secrets of a stage's own links, for its host only: its upstream's (stage i-1
    dials it), its downstream's (it dials stage i+1; the tail's next stage is the head) and,
    at the head and the tail, the bridge's link to it (None elsewhere)."""
    plan, i = stage.plan, stage.index
    up, down = (i - 1) % n_stages, (i + 1) % n_stages
    return {
        "upstream": {"stage": up, "secret": link_secret(plan, upstream=up, downstream=i)},
        "downstream": {"stage": down, "secret": link_secret(plan, upstream=i, downstream=down)},
        "bridge": link_secret(plan, upstream=None, downstream=i) if i in (0, n_stages - 1) else None,
    }


def bridge_links(plan: RingPlan) -> dict:
    """The secrets of the bridge's links to the head and the tail, for the bridge host only."""
    last = plan.stages.count() - 1
    return {
        "head": link_secret(plan, upstream=None, downstream=0),
        "tail": link_secret(plan, upstream=None, downstream=last),
    }


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
        "stage": stage.index,
        "start": stage.start,
        "end": stage.end,
        "host": stage.host_id,
        "hold_s": stage.hold_s,
        "idle_s": stage.idle_s,
        "queue_depth": stage.queue_depth,
        "batches": stage.batches,
        "hold_share": round(stage.hold_s / busy, 4) if busy else None,
        "reported_at": stage.reported_at,
    }


def stage_address(stage: RingStage) -> dict:
    """Where a stage listens, as it last reported ("" until it has)."""
    return {
        "stage": stage.index,
        "start": stage.start,
        "end": stage.end,
        "host": stage.host_id,
        "address": stage.address,
        "reported_at": stage.address_reported_at,
    }


def bridged_model_ids(*, host_id: int) -> list[int]:
    """The models this host serves through a ring it bridges (active plans): it scores no
    audit of them (a bridge holds no whole model to read one with)."""
    return sorted(
        set(
            RingPlan.objects.filter(bridge_host_id=host_id, status=RingPlan.Status.ACTIVE).values_list(
                "model_id", flat=True
            )
        )
    )


def ring_layers(*, bridge_host_id: int, model_id: int) -> tuple[RingPlan, dict[int, int]] | None:
    """The ring this host serves `model_id` through, if it bridges an active one, and the
    layers each of its hosts runs (a host-less stage is the bridge's): what a ring's tokens
    are paid by. None for a host serving the model on its own machine."""
    plan = (
        RingPlan.objects.filter(bridge_host_id=bridge_host_id, model_id=model_id, status=RingPlan.Status.ACTIVE)
        .order_by("-created_at", "-pk")
        .first()
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
    """May this host dial stage `index` through the relay? Only a neighbour that dials it:
    the host that runs its upstream stage (index - 1; the tail's for the head), or the ring's
    bridge where `index` is the head or the tail. (The stage's handshake refuses anyone else
    anyway, `mahout.ring.keys`; this keeps the others from even reaching it.)"""
    plan = RingPlan.objects.filter(pk=plan_id, status=RingPlan.Status.ACTIVE).first()
    n_stages = 0 if plan is None else plan.stages.count()
    if plan is None or not 0 <= index < n_stages:
        return False
    if plan.bridge_host_id == host_id and index in (0, n_stages - 1):
        return True
    return RingStage.objects.filter(stage_runner_q(Host(pk=host_id)), plan=plan, index=(index - 1) % n_stages).exists()
