"""Writes for the expert market: registering MoE models, coordinator reports, handing
volunteers a slice, worker registration and heartbeats, and ageing workers out.

Everything is pulled by hosts (coordinators report, volunteers ask, workers heartbeat), so
machines behind NAT take part. Nothing is first come: a model's coordinator is bound by the
operator when it is registered, a host that accepts work (not banned, in maintenance or
paused) may volunteer, one slice per host at a time, and a worker's address must be public
unless the operator allows private ones (`MOE_ALLOW_PRIVATE_WORKERS`, for a local swarm). Each
worker gets its own link secret, handed to it and to the coordinator only.

Volunteering needs no trust, or a pure volunteer (a machine that serves no jobs, so never
earns it) could never be recruited. It needs none because the coordinator holds the whole
model and recomputes a share of every worker's batches: a host that is not trusted is on
*expert probation* (`selectors.probation_hosts`), checked at `MOE_PROBATION_CHECK_SHARE`
(default half its batches) until its workers have passed `MOE_PROBATION_CHECKS`, then at the
coordinator's usual share like a trusted host. A worker whose recomputed batch disagrees is
blamed and retired at once, its answer replaced by the coordinator's, and no machine of its
host's owner may volunteer again. What a volunteer sees (hidden states of one layer's routed
rows) is less than what a host in probation already sees when it serves a job (the prompt).

Load-adaptive recruitment is the sum of small rules: a saturated report raises the model's
effective target (`mesh.experts.selectors`), slices covered below it are handed to
volunteers, and once the coordinator has been quiet for `MOE_COOLDOWN_SECONDS` workers
beyond the target are retired (their next heartbeat says so) and stale ones are dropped. The
control plane's own loop (`expert_market_tick`, a Celery beat task) reviews every model
whether or not anyone reports: a coordinator that stopped reporting is marked silent
(`silent_since`: not saturated, busy 0, no replica wanted) and its workers are released. A
volunteer that leaves (its owner came back) says so (`expert_worker_leave`), and its slice
is scarce again at once.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.db.models import F, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from catalog.models import CatalogModel
from catalog.money import usd_decimal
from catalog.services import CatalogAddRefused, catalog_model_add
from core.errors import DomainError
from core.net import AddressNotPublic, AddressUnresolvable, public_address
from engine.gguf_meta import open_gguf
from engine.moe_gguf import has_byte_vocabulary, read_moe_config, write_expert_slice
from hosts.models import Host
from mesh.experts import selectors
from mesh.experts.models import ExpertModel, ExpertWorker

__all__ = [
    "MoeRefused",
    "coordinator_failure_excuse",
    "coordinator_report",
    "expert_model_register",
    "moe_model_publish",
    "expert_slice_file",
    "expert_volunteer",
    "expert_worker_heartbeat",
    "expert_worker_register",
    "expert_market_tick",
    "expert_model_review_one",
    "expert_worker_leave",
    "expert_workers_age_out",
    "expert_workers_blame",
    "worker_address_check",
]


class MoeRefused(DomainError):
    """A request the market refuses; carries the HTTP status and error code to answer with."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(
            message, status=status, code=code, type="permission_error" if status == 403 else "invalid_request_error"
        )


@transaction.atomic
def expert_model_register(
    *,
    name: str,
    gguf_path: str | Path,
    slice_size: int = 4,
    base_target: int = 0,
    boost: int = 1,
    saturation_threshold: int = 2,
    coordinator: Host | None = None,
) -> ExpertModel:
    """Record (or update) an MoE model from its GGUF metadata: layers and expert count."""
    config = read_moe_config(open_gguf(gguf_path))
    model, _ = ExpertModel.objects.update_or_create(
        name=name,
        defaults={
            "gguf_path": str(gguf_path),
            "arch": config.arch,
            "n_layers": config.n_layers,
            "n_experts": config.n_experts,
            "n_experts_used": config.n_experts_used,
            "slice_size": slice_size,
            "base_target": base_target,
            "boost": boost,
            "saturation_threshold": saturation_threshold,
            "coordinator": coordinator,
        },
    )
    return model


BYTES_TOKENIZER = "bytes"


@transaction.atomic
def moe_model_publish(
    *,
    name: str,
    gguf_path: str | Path,
    input_price_ucents: int = 10,
    output_price_ucents: int = 40,
    slice_size: int = 4,
    base_target: int = 0,
    boost: int = 1,
    saturation_threshold: int = 2,
    coordinator: Host | None = None,
) -> tuple[ExpertModel, CatalogModel]:
    """Put an MoE GGUF on sale: create or update its expert-market record (layers and expert
    count from the file) and its marketplace catalog entry (kind chat, the file's context
    length, prices in µ¢ per token), so a coordinator can qualify it and customers can call it.

    `coordinator` binds the host that coordinates the model (only it may report for it and is
    handed its workers' secrets); a new model needs one, an update without one keeps the
    bound host. A banned host is refused.

    Tokens are counted with the model's own vocabulary, as its coordinator's runner
    (`mahout.moe.runner`) tokenizes: a real one (Qwen 3 MoE's BPE) enters the catalog as any
    chat model does (`catalog.services.catalog_model_add`: a vocabulary-only copy the gateway
    counts with, the file's chat template, the file pinned by sha256); the byte vocabulary of
    the generated test model counts with the `bytes` tokenizer, which is exactly its count
    (ids 0..255 are the UTF-8 bytes, plus BOS). A file the catalog cannot take (no chat
    template, already on sale under another name) is refused with the catalog's reason.
    """
    reader = open_gguf(gguf_path)
    config = read_moe_config(reader)
    known = ExpertModel.objects.select_for_update().filter(name=name).first()
    coordinator = coordinator or (known.coordinator if known else None)
    if coordinator is None:
        raise MoeRefused(
            400,
            f"{name!r} has no coordinator yet: name the host that will coordinate it "
            "(moe_register --coordinator-host NAME).",
            "coordinator_required",
        )
    if coordinator.banned_at is not None:
        raise MoeRefused(403, f"Host {coordinator.name!r} is banned and cannot coordinate {name!r}.", "host_banned")
    prices = {"input_price_ucents": input_price_ucents, "output_price_ucents": output_price_ucents}
    if has_byte_vocabulary(reader):
        catalog, _ = CatalogModel.objects.update_or_create(
            name=name,
            defaults={
                "kind": CatalogModel.Kind.CHAT,
                "context_length": config.context_length,
                "tokenizer": BYTES_TOKENIZER,
                "active": True,
                **prices,
            },
        )
    else:
        catalog = _vocabulary_entry(name, Path(gguf_path), prices)
    expert_model = expert_model_register(
        name=name,
        gguf_path=gguf_path,
        slice_size=slice_size,
        base_target=base_target,
        boost=boost,
        saturation_threshold=saturation_threshold,
        coordinator=coordinator,
    )
    return expert_model, catalog


def _vocabulary_entry(name: str, path: Path, prices: dict[str, int]) -> CatalogModel:
    """The catalog entry of an MoE file with its own vocabulary: added from the file the first
    time (refused with the catalog's reason), its prices updated afterwards."""
    entry = CatalogModel.objects.filter(name=name).first()
    if entry is not None and entry.tokenizer == BYTES_TOKENIZER:
        raise MoeRefused(
            409,
            f"{name!r} is on sale with a byte vocabulary; publish this file under another name.",
            "vocabulary_changed",
        )
    if entry is None:
        input_price = usd_decimal(prices["input_price_ucents"] * 1_000_000)  # USD per million, exactly
        output_price = usd_decimal(prices["output_price_ucents"] * 1_000_000)
        try:
            entry = catalog_model_add(path=path, name=name, input_price=input_price, output_price=output_price)
        except CatalogAddRefused as refused:
            raise MoeRefused(400, f"{path} cannot enter the catalog: {refused}", "catalog_add_refused") from None
    CatalogModel.objects.filter(pk=entry.pk).update(active=True, **prices)
    entry.refresh_from_db()
    return entry


@transaction.atomic
def coordinator_report(
    *,
    host: Host,
    model_name: str,
    busy: int,
    workers: Sequence[dict] = (),
    blamed: Sequence[dict] = (),
    engaged_experts: int | None = None,
    probed_experts: int | None = None,
    now: datetime | None = None,
) -> ExpertModel:
    """Record a coordinator's busy slots (saturated when busy >= threshold), the
    `last_serve_ms` and `checks_passed` it saw per worker (each only ever grows: a restarted
    coordinator counts from zero again), and the workers it blames (`expert_workers_blame`).
    A report ends the model's silence. Only the host the operator bound to the model may
    report: reporting first claims nothing.

    `engaged_experts` and `probed_experts` (since its previous report; None from a coordinator
    that does not count them) say whether it uses its workers: experts it sent measured workers
    because their round trips beat computing here, and experts it sent only as shadow probes.
    Saturated, probing and engaging none, it starts `remote_unused_since` (the boost is then
    held back: `selectors.boost_held`); engaging any clears it."""
    now = now or timezone.now()
    model = ExpertModel.objects.select_for_update().filter(name=model_name).first()
    if model is None:
        raise MoeRefused(404, f"No MoE model {model_name!r}.", "moe_model_not_found")
    if model.coordinator_id is None:
        raise MoeRefused(
            403,
            f"No coordinator is bound to {model_name!r}; an operator binds one with "
            "manage.py moe_register PATH --name NAME --coordinator-host HOST.",
            "coordinator_not_bound",
        )
    if model.coordinator_id != host.pk:
        raise MoeRefused(
            403,
            f"This host does not coordinate {model_name!r}: the operator bound another host to it.",
            "not_the_coordinator",
        )
    model.busy = busy
    model.saturated = busy >= model.saturation_threshold
    model.reported_at = now
    model.silent_since = None
    if model.saturated:
        model.last_saturated_at = now
    if engaged_experts:
        model.remote_unused_since, model.last_engaged_at = None, now
    elif (
        model.saturated
        and probed_experts
        and (
            model.remote_unused_since is None
            or now - model.remote_unused_since >= selectors.seconds("MOE_UNUSED_RETRY_SECONDS")
        )
    ):
        model.remote_unused_since = now
    model.save(
        update_fields=[
            "busy",
            "saturated",
            "reported_at",
            "last_saturated_at",
            "silent_since",
            "remote_unused_since",
            "last_engaged_at",
        ]
    )
    for report in workers:
        own = ExpertWorker.objects.filter(pk=report["id"], model=model)
        own.filter(last_serve_ms__lt=report["last_serve_ms"]).update(last_serve_ms=report["last_serve_ms"])
        checks = report.get("checks_passed", 0)
        own.filter(checks_passed__lt=checks).update(checks_passed=checks)
    if blamed:
        expert_workers_blame(model=model, blamed=blamed, now=now)
    expert_workers_age_out(model=model, now=now)
    return model


def coordinator_failure_excuse(
    *, host: Host, model_name: str, since: datetime, now: datetime | None = None
) -> str | None:
    """Why a failed audit of `host`'s answer for `model_name` (a request made at `since`) is
    not the host's fault, or None. It is excused when `host` coordinates that MoE model, its
    workers computed experts on merit since `since` (`last_engaged_at`: a volunteer's wrong
    values may be in the answer; shadow probes never are, and every probe is checked), and no
    failure was excused within `MOE_EXCUSE_SECONDS`. An excuse recomputes every batch of the
    model's workers for that window (`selectors.dispatch_map`), so a worker wrong again is
    blamed by the coordinator's own check, and the next failure is the coordinator's. The
    customer is refunded either way (`marketplace.trust.audits.audit_decide`)."""
    now = now or timezone.now()
    model = ExpertModel.objects.select_for_update().filter(name=model_name, coordinator=host).first()
    if model is None or model.last_engaged_at is None or model.last_engaged_at < since:
        return None
    if selectors.excused_lately(model, now=now):
        return None
    model.excused_at = now
    model.save(update_fields=["excused_at"])
    return (
        f"its expert workers computed part of this answer; every batch of theirs is recomputed until "
        f"{(now + selectors.seconds('MOE_EXCUSE_SECONDS')).isoformat(timespec='seconds')}, and a failure "
        "in that time is the coordinator's own"
    )


BLAME_REASON_MAX = ExpertWorker._meta.get_field("blame_reason").max_length


@transaction.atomic
def expert_workers_blame(*, model: ExpertModel, blamed: Sequence[dict], now: datetime | None = None) -> int:
    """Take the workers `model`'s coordinator blames (each ``{"id", "reason"}``: a batch it
    recomputed disagreed) out of the market: retired now, so no coordinator is handed them and
    their next heartbeat tells them to stop, and marked with when and why. A worker of another
    model is refused whole (a coordinator judges only its own workers). Blaming again changes
    nothing: the first reason stands. Returns how many were newly blamed.

    Expert workers are not paid per batch (no ledger entry follows `last_serve_ms`), so there is
    no earning to withhold here."""
    now = now or timezone.now()
    ids = {int(entry["id"]) for entry in blamed}
    own = set(ExpertWorker.objects.filter(pk__in=ids, model=model).values_list("pk", flat=True))
    if ids - own:
        raise MoeRefused(
            403,
            f"Expert workers {sorted(ids - own)} do not serve {model.name!r}: a coordinator may "
            "blame only its own model's workers.",
            "worker_not_in_model",
        )
    newly = 0
    for entry in blamed:
        newly += ExpertWorker.objects.filter(pk=entry["id"], model=model, blamed_at__isnull=True).update(
            status=ExpertWorker.Status.RETIRED,
            retired_at=Coalesce(F("retired_at"), Value(now)),
            blamed_at=now,
            blame_reason=str(entry.get("reason") or "")[:BLAME_REASON_MAX],
            retired_reason="blamed by its coordinator",
        )
    return newly


def _pick_slice(host: Host, now: datetime) -> tuple[ExpertModel, selectors.SliceDemand] | None:
    """The scarcest slice this host does not already cover: most missing, saturated models
    first, then by model, layer and first expert."""
    best: tuple[tuple, ExpertModel, selectors.SliceDemand] | None = None
    for model in ExpertModel.objects.select_for_update().order_by("name"):
        mine = set(selectors.covering_workers(model, now=now).filter(host=host).values_list("layer", "first"))
        saturated = selectors.is_saturated(model, now=now)
        for demand in selectors.slice_coverage(model, now=now):
            if demand.missing <= 0 or (demand.layer, demand.first) in mine:
                continue
            rank = (-demand.missing, not saturated, model.name, demand.layer, demand.first)
            if best is None or rank < best[0]:
                best = (rank, model, demand)
    return None if best is None else (best[1], best[2])


def _volunteer_refusal(host: Host) -> MoeRefused | None:
    """Why this host may not serve experts now, or None. Trust is not asked (see the module's
    docstring: an untrusted host serves on probation); a machine whose owner had a worker
    blamed, on any of their machines, never serves again."""
    if host.banned_at is not None:
        return MoeRefused(403, f"This host is banned ({host.ban_reason}); it cannot serve experts.", "host_banned")
    blamed = ExpertWorker.objects.filter(host__owner_id=host.owner_id, blamed_at__isnull=False).first()
    if blamed is not None:
        return MoeRefused(
            403,
            f"A coordinator found expert worker {blamed.pk} of this host's owner answering wrong "
            f"values ({blamed.blame_reason}); their machines cannot serve experts.",
            "host_blamed",
        )
    if host.maintenance_since is not None:
        return MoeRefused(
            403,
            f"This host is in maintenance ({host.maintenance_reason}); it cannot serve experts.",
            "host_in_maintenance",
        )
    if host.paused:
        return MoeRefused(409, "This host is paused by its owner; resume it to serve experts.", "host_paused")
    return None


@transaction.atomic
def expert_volunteer(*, host: Host, now: datetime | None = None) -> ExpertWorker | None:
    """Hand an idle host the scarcest (layer, expert-range) slice, or None when nothing is
    scarce (an untrusted one serves it on probation); a host refused by `_volunteer_refusal`
    is refused, and so is one that already holds a slice (one at a time). The host's row
    lock serialises its own concurrent asks; the model rows are locked, so concurrent
    volunteers never fill the same gap twice."""
    now = now or timezone.now()
    host = Host.objects.select_for_update().get(pk=host.pk)
    refusal = _volunteer_refusal(host)
    if refusal is not None:
        raise refusal
    held = selectors.live_worker_of_host(host=host, now=now)
    if held is not None:
        raise MoeRefused(
            409,
            f"This host already serves expert worker {held.pk} ({held.model.name} layer {held.layer}); "
            "one slice at a time.",
            "host_already_serving",
        )
    picked = _pick_slice(host, now)
    if picked is None:
        return None
    model, demand = picked
    return ExpertWorker.objects.create(
        model=model, host=host, layer=demand.layer, first=demand.first, count=demand.count
    )


def worker_address_check(address: str) -> str:
    """The ``IP:PORT`` a coordinator may dial for a worker's reported ``HOST:PORT`` ("" stays
    "": the relay). The name is resolved here, once, and the coordinator is handed the address
    that was checked, so a name that resolves elsewhere later changes nothing. Loopback,
    private, link-local, multicast and other non-public addresses are refused (a stranger
    must not make the coordinator dial its own network) unless `MOE_ALLOW_PRIVATE_WORKERS`,
    which keeps the address as reported."""
    if not address:
        return ""
    name, _, port_text = address.rpartition(":")
    name = name.strip("[]")
    port = int(port_text) if port_text.isdigit() else 0
    if not name or not 0 < port < 65536:
        raise MoeRefused(400, f"{address!r} is not HOST:PORT.", "address_invalid")
    if settings.MOE_ALLOW_PRIVATE_WORKERS:
        return address
    try:
        return public_address(name, port)
    except AddressUnresolvable as exc:
        raise MoeRefused(
            400, f"The worker address {address!r} does not resolve ({exc}).", "address_unresolvable"
        ) from exc
    except AddressNotPublic as exc:
        raise MoeRefused(
            400,
            f"The worker address {address!r} is not public ({exc.ip}): a coordinator dials only public "
            "addresses; behind NAT, serve through the relay (the default: without --direct or --advertise).",
            "address_not_public",
        ) from exc


@transaction.atomic
def expert_worker_register(
    *, worker_id: int, host: Host, address: str = "", now: datetime | None = None
) -> ExpertWorker:
    """ASSIGNED -> ACTIVE (compare-and-set): the worker holds its slice and is reachable at
    `address` (checked by `worker_address_check`; blank: through the relay). Registering
    again just updates the address. A host `_volunteer_refusal` refuses is refused."""
    now = now or timezone.now()
    refusal = _volunteer_refusal(host)
    if refusal is not None:
        raise refusal
    address = worker_address_check(address)
    rows = ExpertWorker.objects.filter(pk=worker_id, host=host)
    changed = rows.filter(status=ExpertWorker.Status.ASSIGNED).update(
        status=ExpertWorker.Status.ACTIVE, address=address, registered_at=now, heartbeat_at=now
    )
    if not changed and not rows.filter(status=ExpertWorker.Status.ACTIVE).update(address=address, heartbeat_at=now):
        raise MoeRefused(
            409, f"Expert worker {worker_id} is not assigned to this host (or has retired).", "worker_not_assigned"
        )
    return rows.get()


@transaction.atomic
def expert_worker_heartbeat(*, worker_id: int, host: Host, now: datetime | None = None) -> bool:
    """Keep an ACTIVE worker's coverage fresh; returns True when it must retire (it was
    aged out, or it is no longer needed)."""
    now = now or timezone.now()
    worker = ExpertWorker.objects.select_for_update().filter(pk=worker_id, host=host).first()
    if worker is None:
        raise MoeRefused(404, f"No expert worker {worker_id} of this host.", "worker_not_found")
    if worker.status == ExpertWorker.Status.ACTIVE:
        ExpertWorker.objects.filter(pk=worker.pk, status=ExpertWorker.Status.ACTIVE).update(heartbeat_at=now)
        expert_workers_age_out(model=worker.model, now=now)
    return ExpertWorker.objects.get(pk=worker.pk).status == ExpertWorker.Status.RETIRED


def expert_worker_leave(*, worker_id: int, host: Host, reason: str = "", now: datetime | None = None) -> bool:
    """The worker's volunteer is leaving (its owner came back, or it is stopping): retire it
    now (compare-and-set), so it leaves the dispatch map at its coordinator's next report and
    its slice reads scarce again at once, rather than after `MOE_WORKER_STALE_SECONDS`.
    Returns False when it had already retired; another host's worker is refused."""
    now = now or timezone.now()
    rows = ExpertWorker.objects.filter(pk=worker_id, host=host)
    if not rows.exists():
        raise MoeRefused(404, f"No expert worker {worker_id} of this host.", "worker_not_found")
    said = f"left: {reason}" if reason else "left"
    return bool(
        rows.exclude(status=ExpertWorker.Status.RETIRED).update(
            status=ExpertWorker.Status.RETIRED,
            retired_at=now,
            retired_reason=said[:RETIRED_REASON_MAX],
        )
    )


RETIRED_REASON_MAX = ExpertWorker._meta.get_field("retired_reason").max_length


def expert_workers_age_out(*, model: ExpertModel, now: datetime | None = None) -> int:
    """Retire workers that stopped heartbeating, assignments never registered, and, once the
    coordinator has been quiet for the cooldown or while it holds back the boost because it
    does not use its workers (`selectors.boost_held`), workers beyond the effective target
    (the longest-serving and proven are kept; while the coordinator is silent the target is
    0, so all of them). Returns how many were retired."""
    now = now or timezone.now()
    covering = set(selectors.covering_workers(model, now=now).values_list("pk", flat=True))
    live = ExpertWorker.objects.filter(model=model).exclude(status=ExpertWorker.Status.RETIRED)
    stale = set(live.exclude(pk__in=covering).values_list("pk", flat=True))
    extra: set[int] = set()
    quiet_since = model.last_saturated_at
    held = selectors.boost_held(model, now=now)
    if held or quiet_since is None or now - quiet_since >= selectors.seconds("MOE_COOLDOWN_SECONDS"):
        target = selectors.effective_target(model, now=now)
        by_slice: dict[tuple[int, int], list[ExpertWorker]] = {}
        for worker in live.filter(pk__in=covering).order_by("-last_serve_ms", "id"):
            by_slice.setdefault((worker.layer, worker.first), []).append(worker)
        for workers in by_slice.values():
            extra.update(w.pk for w in workers[target:])
    if not selectors.coordinator_reporting(model, now=now):
        unneeded = "its coordinator went silent"
    elif held:
        unneeded = "its coordinator computes faster than it answers (it sent only probes)"
    else:
        unneeded = "no longer needed"
    retire = ExpertWorker.Status.RETIRED
    return live.filter(pk__in=stale).update(
        status=retire, retired_at=now, retired_reason="stopped heartbeating"
    ) + live.filter(pk__in=extra).update(status=retire, retired_at=now, retired_reason=unneeded)


@transaction.atomic
def expert_model_review_one(*, model_id: int, now: datetime | None = None) -> int:
    """The control plane's own look at one model, whether or not its coordinator reports: a
    coordinator without a fresh report is marked silent (not saturated, busy 0: a silent
    coordinator keeps no swarm recruited) and the model's workers are aged out (the silent
    model's all of them, once the cooldown since its last saturation has passed). Under the
    model's row lock, so a report arriving meanwhile wins whole. Returns the changes made."""
    now = now or timezone.now()
    model = ExpertModel.objects.select_for_update().filter(pk=model_id).first()
    if model is None:
        return 0
    changed = 0
    if model.silent_since is None and not selectors.coordinator_reporting(model, now=now):
        model.silent_since, model.saturated, model.busy = now, False, 0
        model.save(update_fields=["silent_since", "saturated", "busy"])
        changed = 1
    return changed + expert_workers_age_out(model=model, now=now)


def expert_market_tick(*, now: datetime | None = None) -> int:
    """Review every MoE model (`expert_model_review_one`); the Celery beat task's body."""
    return sum(expert_model_review_one(model_id=pk, now=now) for pk in ExpertModel.objects.values_list("pk", flat=True))


def expert_slice_file(*, worker: ExpertWorker) -> Path:
    """The GGUF holding only this worker's slice, cut once from the model file and cached."""
    if worker.status == ExpertWorker.Status.RETIRED:
        raise MoeRefused(409, f"Expert worker {worker.pk} has retired.", "worker_retired")
    model = worker.model
    source = os.stat(model.gguf_path)  # the cache is keyed by the file's identity: a replaced file is cut afresh
    identity = hashlib.sha256(f"{model.gguf_path}|{source.st_size}|{source.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = Path(settings.VAR_DIR) / "moe-slices"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{identity}-{worker.layer}-{worker.first}-{worker.count}.gguf"
    if not path.exists():  # write aside, then rename: a concurrent reader never sees half a file
        handle, scratch = tempfile.mkstemp(dir=folder, suffix=".part")
        os.close(handle)
        write_expert_slice(model.gguf_path, worker.layer, worker.first, worker.count, scratch)
        os.replace(scratch, path)
    return path
