"""Writes for ring plans: creating a valid plan (by an operator, or a host's own ring on its
own machine), recording where stages listen (and forgetting it when a stage leaves, so
nobody dials a stale address) and what they report; recording a disputed link (the ring is
retired and the two hosts are kept apart, `ring_link_dispute_record`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from catalog.models import CatalogModel
from core.errors import DomainError
from core.net import AddressNotPublic, AddressUnresolvable, public_address
from engine.arch import ARCHITECTURES, layer_bytes
from engine.gguf_meta import open_gguf
from hosts.models import Host
from mesh.rings.models import ModelLayout, RingLinkDispute, RingPlan, RingStage
from mesh.rings.selectors import stage_runner_q
from protocol.ring import RELAY_ADDRESS

DISPUTE_AVOID_DAYS = 30  # how long two hosts that disputed a link are kept from being neighbours again


class PlanInvalid(DomainError, ValueError):
    """A plan that cannot serve its model; the message says why."""

    code = "plan_invalid"


class NotAParticipant(DomainError, PermissionError):
    """A host reported for a ring (or a stage) it does not serve."""

    status = 404
    code = "ring_not_found"


class NotYourStage(DomainError, PermissionError):
    """A host reported for a stage of a ring it serves, but not that stage."""

    status = 403
    code = "not_your_stage"


class AddressInvalid(DomainError, ValueError):
    """A stage reported an address its neighbours could not dial."""

    code = "address_invalid"
    param = "address"


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


def ring_model(model_name: str) -> tuple[CatalogModel, int]:
    """The catalog entry a ring may serve and its layer count: a recorded `ModelLayout`, else
    the block count `catalog_add` read from the entry's own file. Refused (PlanInvalid): an
    unknown model, an embedding model, a mixture of experts (the expert market serves those),
    an architecture the ring's engine does not run, a model whose layer count is not known."""
    model = CatalogModel.objects.filter(name=model_name).first()
    if model is None:
        raise PlanInvalid(f"unknown model {model_name!r}")
    if model.kind != CatalogModel.Kind.CHAT:
        raise PlanInvalid(f"{model_name!r} is not a chat model ({model.kind}); a ring serves chat models")
    if model.n_experts:
        raise PlanInvalid(
            f"{model_name!r} is a mixture of experts: the expert market serves it (moe_register), not a ring"
        )
    if model.architecture and model.architecture not in ARCHITECTURES:
        raise PlanInvalid(
            f"{model_name!r} is a {model.architecture} model; a ring's engine runs {', '.join(sorted(ARCHITECTURES))}"
        )
    layout = ModelLayout.objects.filter(model=model).first()
    n_layers = layout.n_layers if layout is not None else model.n_layers
    if not n_layers:
        raise PlanInvalid(f"the layer count of {model_name!r} is not known; record its layout first")
    return model, n_layers


def layer_mb_read(model: CatalogModel) -> float:
    """MB one layer takes on a stage, read from the entry's weights file (`engine.arch.layer_bytes`:
    float16 matrices, as the engine holds them). Refused when the gateway has no readable file."""
    if not model.weights_path:
        raise PlanInvalid(f"the gateway holds no weights file for {model.name!r}: give the memory one layer takes")
    try:
        return layer_bytes(open_gguf(model.weights_path)) / 2**20
    except (OSError, ValueError) as error:
        raise PlanInvalid(f"cannot read {model.name!r}'s layers from {model.weights_path}: {error}") from None


@transaction.atomic
def ring_plan_create(
    *,
    model_name: str,
    stages: Sequence[StageSpec],
    row_width: int,
    micro_batch: int,
    bridge_host: Host | None = None,
) -> RingPlan:
    """Validate and store a plan; refuses one stage, gaps, overlaps, ranges past the model, widths <= 0."""
    model, n_layers = ring_model(model_name)
    plan_check(n_layers=n_layers, stages=stages, row_width=row_width, micro_batch=micro_batch)
    disputes_check(stages=stages, bridge_host=bridge_host)
    plan = RingPlan.objects.create(
        model=model, n_layers=n_layers, row_width=row_width, micro_batch=micro_batch, bridge_host=bridge_host
    )
    RingStage.objects.bulk_create(
        RingStage(plan=plan, index=i, start=s.start, end=s.end, host=s.host) for i, s in enumerate(stages)
    )
    return plan


def _links(stages: Sequence[StageSpec], bridge_host: Host | None) -> list[tuple[Host | None, Host | None, str]]:
    """Every link of a plan as (sender's host, receiver's host, which link): stage i -> i+1
    (the tail's to the head) and the bridge's to the head and the tail. A host-less stage is
    the bridge host's."""
    hosts = [stage.host or bridge_host for stage in stages]
    n = len(hosts)
    return [
        *((hosts[i], hosts[(i + 1) % n], f"stage {i} -> stage {(i + 1) % n}") for i in range(n)),
        (bridge_host, hosts[0], "the bridge -> the head"),
        (bridge_host, hosts[-1], "the bridge -> the tail"),
    ]


def disputes_check(*, stages: Sequence[StageSpec], bridge_host: Host | None) -> None:
    """Refuse (PlanInvalid) a plan whose link joins two hosts that disputed a link of a ring
    in the last `DISPUTE_AVOID_DAYS` days, either way round: one of the two lied, nobody could
    tell which, so they are not put at the two ends of a link again."""
    since = timezone.now() - timedelta(days=DISPUTE_AVOID_DAYS)
    for sender, receiver, link in _links(stages, bridge_host):
        if sender is None or receiver is None or sender.pk == receiver.pk:
            continue
        pair = Q(upstream_host=sender, downstream_host=receiver) | Q(upstream_host=receiver, downstream_host=sender)
        if RingLinkDispute.objects.filter(pair, created_at__gte=since).exists():
            raise PlanInvalid(
                f"{link} would join hosts {sender.name!r} and {receiver.name!r}, whose evidence of a ring "
                f"link disagreed within the last {DISPUTE_AVOID_DAYS} days (neither could be shown at "
                "fault): put another stage between them, or leave one out"
            )


@transaction.atomic
def ring_link_dispute_record(*, plan_id: int, upstream: int, downstream: int, reason: str) -> RingLinkDispute:
    """A ring inquiry found the link from stage `upstream` (-1: the bridge) to stage
    `downstream` disputed and could not tell which end lied: record the pair (no forfeit:
    that is the inquiry's rule, `marketplace.trust.ring_inquiries`), and retire the ring (a
    compare-and-set: it may be retired already), so that it is planned again without the
    two as neighbours (`disputes_check`)."""
    plan = RingPlan.objects.select_for_update().get(pk=plan_id)
    runners = {stage.index: stage.host_id or plan.bridge_host_id for stage in RingStage.objects.filter(plan=plan)}
    sender = plan.bridge_host_id if upstream < 0 else runners.get(upstream)
    receiver = runners.get(downstream)
    if sender is None or receiver is None:
        raise PlanInvalid(f"ring {plan_id} has no link from {upstream} to {downstream} with a host at each end")
    dispute = RingLinkDispute.objects.create(
        plan=plan,
        upstream_index=upstream,
        downstream_index=downstream,
        upstream_host_id=sender,
        downstream_host_id=receiver,
        reason=reason[:2000],
    )
    RingPlan.objects.filter(pk=plan.pk, status=RingPlan.Status.ACTIVE).update(status=RingPlan.Status.RETIRED)
    return dispute


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
            hold_s=report["hold_s"],
            idle_s=report["idle_s"],
            queue_depth=report["queue_depth"],
            batches=report.get("batches", 0),
            reported_at=now,
        )
        if not changed:  # the whole report is refused (the transaction rolls back)
            raise NotYourStage(f"host {host.pk} does not serve stage {report['stage']} of ring {plan_id}")
        updated += changed
    return updated


def even_ranges(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Contiguous slices of [0, n_layers) whose sizes differ by at most one."""
    if n_stages < 1 or n_stages > n_layers:
        raise PlanInvalid(f"cannot split {n_layers} layers into {n_stages} stages")
    base, extra = divmod(n_layers, n_stages)
    bounds = [0]
    for i in range(n_stages):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return list(zip(bounds, bounds[1:], strict=False))


@transaction.atomic
def ring_plan_propose_local(
    *, host: Host, model_name: str, n_stages: int, row_width: int, micro_batch: int
) -> RingPlan:
    """A host's own ring on its own machine: every stage on `host`, which also bridges it.

    Idempotent: an active plan of this host with the same model, stage count and widths is
    returned rather than a new one made (a restarted ring keeps its id). The host's row lock
    serialises two proposals racing each other. The layers are split evenly.
    """
    Host.objects.select_for_update().filter(pk=host.pk).first()
    if n_stages < 2:
        raise PlanInvalid("a pipeline needs at least two stages")
    candidates = RingPlan.objects.filter(
        bridge_host=host,
        model__name=model_name,
        status=RingPlan.Status.ACTIVE,
        row_width=row_width,
        micro_batch=micro_batch,
    ).order_by("-pk")
    for plan in candidates:
        if plan.stages.count() == n_stages and not plan.stages.exclude(host=host).exists():
            return plan
    _, n_layers = ring_model(model_name)
    stages = [StageSpec(start, end, host) for start, end in even_ranges(n_layers, n_stages)]
    return ring_plan_create(
        model_name=model_name, stages=stages, row_width=row_width, micro_batch=micro_batch, bridge_host=host
    )


def memory_split(*, n_layers: int, capacities: Sequence[int]) -> list[int]:
    """Layers per host, proportional to how many each can hold (`capacities`), never
    more than that; hosts that end with none are left out by the caller."""
    total = sum(capacities)
    if total < n_layers:
        raise PlanInvalid(f"the hosts' advertised memory holds {total} of the model's {n_layers} layers")
    quotas = [n_layers * c / total for c in capacities]
    layers = [min(int(q), c) for q, c in zip(quotas, capacities, strict=True)]
    by_remainder = sorted(range(len(capacities)), key=lambda i: quotas[i] - int(quotas[i]), reverse=True)
    while sum(layers) < n_layers:  # hand the rounding remainder to hosts with room, largest share first
        for i in by_remainder:
            if sum(layers) < n_layers and layers[i] < capacities[i]:
                layers[i] += 1
    return layers


@transaction.atomic
def ring_plan_propose(
    *,
    model_name: str,
    hosts: Sequence[Host],
    bridge_host: Host | None,
    layer_mb: float | None = None,
    row_width: int,
    micro_batch: int,
) -> RingPlan:
    """A plan from the hosts' advertised memory (the `memory_budget_mb` of their heartbeat
    catalogs): stages in the order given, each holding layers in proportion to what its
    host can hold at `layer_mb` per layer (default: read from the model's file, `layer_mb_read`).
    Refused when a host has not advertised its memory, when together they cannot hold the
    model, or when fewer than two stages result.
    """
    model, n_layers = ring_model(model_name)
    if layer_mb is None:
        layer_mb = layer_mb_read(model)
    if layer_mb <= 0:
        raise PlanInvalid("layer_mb must be positive")
    capacities = []
    for host in hosts:
        budget = (host.catalog or {}).get("memory_budget_mb")
        if not isinstance(budget, int) or budget <= 0:
            raise PlanInvalid(f"host {host.name!r} has not advertised its memory (no memory budget in its heartbeat)")
        capacities.append(int(budget // layer_mb))
    layers = memory_split(n_layers=n_layers, capacities=capacities)
    stages, start = [], 0
    for host, count in zip(hosts, layers, strict=True):
        if count:
            stages.append(StageSpec(start, start + count, host))
            start += count
    if len(stages) < 2:
        raise PlanInvalid("a pipeline needs at least two stages: give more hosts, or hosts with less memory each")
    return ring_plan_create(
        model_name=model_name, stages=stages, row_width=row_width, micro_batch=micro_batch, bridge_host=bridge_host
    )


def address_check(address: str) -> str:
    """``HOST:PORT`` (an IPv6 host in brackets) that a neighbour can dial; returns it stripped.

    A wildcard host (0.0.0.0, ::) is refused: it is where a socket binds, not where anyone
    can reach it.
    """
    address = address.strip()
    host, colon, port = address.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise AddressInvalid(f"{address!r} is not HOST:PORT")
    if host.strip("[]") in ("0.0.0.0", "::", ""):
        raise AddressInvalid(f"{address!r} is a wildcard: advertise an address neighbours can reach")
    if len(host) > 255 or any(c.isspace() or c in "/@?#" for c in host):
        raise AddressInvalid(f"{host!r} is not a host name or IP address")
    return address


def _owners(plan: RingPlan) -> int:
    """How many people own the ring's machines (its stages' hosts and its bridge)."""
    stage_hosts = plan.stages.exclude(host=None).values_list("host_id", flat=True)
    hosts = {pk for pk in (*stage_hosts, plan.bridge_host_id) if pk is not None}
    return Host.objects.filter(pk__in=hosts).values("owner_id").distinct().count()


def _public(address: str) -> str:
    """The checked public IP:PORT a stranger's stage may be dialled at (`core.net`): a ring
    of one owner's machines may use their own network; a ring of strangers may not make
    each other dial theirs (`RING_ALLOW_PRIVATE_STAGES` allows it, for local tests)."""
    name, _, port = address.rpartition(":")
    try:
        return public_address(name, int(port))
    except AddressUnresolvable as exc:
        raise AddressInvalid(f"{address!r} does not resolve ({exc})") from exc
    except AddressNotPublic as exc:
        raise AddressInvalid(
            f"{address!r} is not public ({exc.ip}): the stages of a ring of several owners' machines "
            "dial only public addresses; behind NAT, a stage is reached through the gateway's ring relay "
            "(`mahout stage` falls back to it by itself, or give --relay)",
            code="address_not_public",
        ) from exc


def _own_stage(*, plan_id: int, index: int, host: Host, active: bool = True) -> RingStage:
    """The stage (locked) that `host` runs, of a ring (an active one unless `active` is False);
    refused for a host outside the ring (404) and for another participant's stage (403)."""
    stages = RingStage.objects.select_for_update().filter(plan_id=plan_id, index=index)
    if active:
        stages = stages.filter(plan__status=RingPlan.Status.ACTIVE)
    stage = stages.select_related("plan").first()
    if stage is None:
        raise NotAParticipant(f"no stage {index} in an {'active ' if active else ''}ring {plan_id}")
    if stage.plan.bridge_host_id != host.pk and not stage.plan.stages.filter(host=host).exists():
        raise NotAParticipant(f"host {host.pk} takes no part in ring {plan_id}")
    if not RingStage.objects.filter(stage_runner_q(host), pk=stage.pk).exists():
        raise NotYourStage(f"host {host.pk} does not run stage {index} of ring {plan_id}")
    return stage


@transaction.atomic
def ring_stage_address_report(*, plan_id: int, index: int, host: Host, address: str) -> RingStage:
    """Record where a stage of an active ring listens; only the host that runs the stage may
    say. `RELAY_ADDRESS` means a stage behind NAT: it is reached through the gateway's ring
    relay (`mesh.rings.consumers`), so it has no address to check."""
    relayed = address.strip() == RELAY_ADDRESS
    address = RELAY_ADDRESS if relayed else address_check(address)
    stage = _own_stage(plan_id=plan_id, index=index, host=host)
    if not relayed and not settings.RING_ALLOW_PRIVATE_STAGES and _owners(stage.plan) > 1:
        address = _public(address)
    stage.address, stage.address_reported_at = address, timezone.now()
    stage.save(update_fields=["address", "address_reported_at"])
    return stage


@transaction.atomic
def ring_stage_leave(*, plan_id: int, index: int, host: Host, address: str) -> bool:
    """The stage that listened at `address` has left: forget the address, so its upstream and
    the bridge wait for its next report instead of dialling a socket that is gone (or, worse,
    one another program took since). A compare-and-set on the address: a leave that arrives
    after the stage reported a new one changes nothing (False). Only the host that runs the
    stage may say; a retired ring's stages may still clear theirs."""
    stage = _own_stage(plan_id=plan_id, index=index, host=host, active=False)
    if not address or stage.address != address:
        return False
    stage.address, stage.address_reported_at = "", timezone.now()
    stage.save(update_fields=["address", "address_reported_at"])
    return True
