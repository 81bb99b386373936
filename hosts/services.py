"""Writes for hosts: creation, qualification, heartbeat, maintenance."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone

from catalog.models import CatalogModel
from core.secrets import secret_hash, secret_new, secret_prefix
from hosts.models import Host, Qualification


@dataclass(frozen=True)
class NewHost:
    host: Host
    token: str


@transaction.atomic
def host_create(*, email: str, name: str) -> NewHost:
    """Create a host (and its owner's user if new). The token is returned once."""
    User = get_user_model()
    owner, _ = User.objects.get_or_create(username=email, defaults={"email": email})
    token = secret_new("host")
    host = Host.objects.create(owner=owner, name=name, token_prefix=secret_prefix(token), token_hash=secret_hash(token))
    return NewHost(host=host, token=token)


class UnknownModel(Exception):
    pass


@transaction.atomic
def qualification_register(
    *, host: Host, model_name: str, fingerprint: str, benchmark: dict, machine: dict
) -> Qualification:
    """Record (or refresh) a host's benchmark of a model on one machine."""
    model = CatalogModel.objects.filter(name=model_name, active=True).first()
    if model is None:
        raise UnknownModel(f"The model '{model_name}' is not in the catalog.")
    figures = {
        "prompt_tps": float(benchmark["prompt_tps"]),
        "gen_tps": float(benchmark["gen_tps"]),
        "ttft_ms": float(benchmark["ttft_ms"]),
        "memory_mb": float(benchmark["memory_mb"]),
        "threads": int(benchmark.get("threads") or 0),
        "machine": machine,
    }
    qualification, _ = Qualification.objects.update_or_create(
        host=host, model=model, fingerprint=fingerprint, defaults=figures
    )
    Host.objects.filter(pk=host.pk).update(fingerprint=fingerprint)
    return qualification


def host_heartbeat(
    *, host: Host, fingerprint: str, paused: bool, models_loaded: list[str], version: str, catalog: object = None
) -> Host:
    """Record that the host is alive, whether its owner paused it, and its catalog.

    A catalog that is missing keeps the last one (it goes stale); one that cannot be
    read is recorded as unknown. Either way routing treats the host as possibly warm
    for every model it qualified, so a bad catalog never costs it work.
    """
    now = timezone.now()
    fields: dict[str, object] = {
        "fingerprint": fingerprint, "paused": paused, "models_loaded": models_loaded, "version": version[:32],
        "last_heartbeat_at": now,
    }
    if catalog is not None:
        readable = catalog_read(catalog)
        fields["catalog"] = readable or {}
        fields["catalog_at"] = now if readable is not None else None
        if readable is not None:
            fields["models_loaded"] = readable["loaded"]
            fields["slots"] = readable["slots"]
    Host.objects.filter(pk=host.pk).update(**fields)
    host.refresh_from_db()
    return host


class MaintenanceReasonMissing(ValueError):
    pass


def host_maintenance_enter(*, host: Host, reason: str, by: str) -> bool:
    """Put the host in maintenance: it claims no new work until resumed.

    Compare-and-set on `maintenance_since`: a host already in maintenance keeps
    its first reason, and False says someone else got there first. The reason
    is shown to the owner, so it is required.
    """
    reason = reason.strip()[:300]
    if not reason:
        raise MaintenanceReasonMissing("A maintenance needs a reason the owner can read.")
    now = timezone.now()
    changed = Host.objects.filter(pk=host.pk, maintenance_since__isnull=True).update(
        maintenance_reason=reason, maintenance_since=now, maintenance_by=by[:100]
    )
    host.refresh_from_db(fields=["maintenance_reason", "maintenance_since", "maintenance_by"])
    return bool(changed)


def host_maintenance_resume(*, host: Host) -> bool:
    """Take the host out of maintenance; False if it was not in maintenance."""
    changed = Host.objects.filter(pk=host.pk, maintenance_since__isnull=False).update(
        maintenance_reason="", maintenance_since=None, maintenance_by=""
    )
    host.refresh_from_db(fields=["maintenance_reason", "maintenance_since", "maintenance_by"])
    return bool(changed)


MAX_SLOTS = 64


def catalog_read(raw: object) -> dict | None:
    """A host's self-reported catalog, normalised; None when it is not readable."""
    if not isinstance(raw, dict):
        return None
    names: dict[str, list[str]] = {}
    for field in ("installed", "qualified", "loaded"):
        value = raw.get(field, [])
        if not isinstance(value, list) or not all(isinstance(name, str) and 0 < len(name) <= 100 for name in value):
            return None
        names[field] = sorted(set(value))
    slots, active = raw.get("slots", 1), raw.get("active_jobs", 0)
    if not isinstance(slots, int) or isinstance(slots, bool) or not 1 <= slots <= MAX_SLOTS:
        return None
    if not isinstance(active, int) or isinstance(active, bool) or active < 0:
        return None
    budget = raw.get("memory_budget_mb")
    return {**names, "slots": slots, "active_jobs": active, "memory_budget_mb": budget if isinstance(budget, int) else None}


def host_socket_opened(*, host_id: int) -> datetime:
    """Record that the host's WebSocket (re)opened; returns when, to compare with later."""
    now = timezone.now()
    Host.objects.filter(pk=host_id).update(socket_since=now)
    return now
