"""Writes for hosts: creation, qualification, heartbeat, maintenance, bans and tokens."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime

from django.contrib.auth import get_user_model
from django.db import transaction
from django.db.models import QuerySet
from django.utils import timezone

from accounts.selectors import account_unconfirmed
from accounts.services import AccountUnconfirmed
from catalog.models import CatalogModel
from core.errors import DomainError
from core.events import announce_on_commit
from core.secrets import secret_hash, secret_new, secret_prefix
from hosts.models import Host, Qualification
from hosts.selectors import machines_allowed
from protocol.catalog import MAX_SLOTS

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NewHost:
    host: Host
    token: str


@transaction.atomic
def host_create(*, email: str, name: str) -> NewHost:
    """Create a host (and its owner's user if new). The token is returned once. An owner who
    signed up and has not confirmed the address raises AccountUnconfirmed; one who has all the
    machines their account may register raises MachineLimitReached (the owner's row is locked,
    so two registrations at once cannot both take the last place)."""
    User = get_user_model()
    owner, _ = User.objects.get_or_create(username=email, defaults={"email": email})
    if account_unconfirmed(owner):
        raise AccountUnconfirmed(f"{email} is not confirmed yet")
    User.objects.select_for_update().filter(pk=owner.pk).first()
    allowed = machines_allowed(owner)
    if Host.objects.filter(owner=owner).count() >= allowed:
        raise MachineLimitReached(
            f"{email} already has {allowed} machines, the most one account may register; an operator can raise "
            "the limit for this account"
        )
    token = secret_new("host")
    host = Host.objects.create(owner=owner, name=name, token_prefix=secret_prefix(token), token_hash=secret_hash(token))
    return NewHost(host=host, token=token)


class MachineLimitReached(Exception):
    """The owner already has as many machines as their account may register."""


class WrongModelFile(Exception):
    """A qualification of another file than the one the catalog pins."""


class UnknownModel(Exception):
    pass


@transaction.atomic
def qualification_register(
    *,
    host: Host,
    model_name: str,
    fingerprint: str,
    benchmark: dict,
    machine: dict,
    sha256: str = "",
) -> Qualification:
    """Record (or refresh) a host's benchmark of a model on one machine. A catalog model that
    pins its file (`CatalogModel.sha256`) takes only a benchmark of that very file."""
    model = CatalogModel.objects.filter(name=model_name, active=True).first()
    if model is None:
        raise UnknownModel(f"The model '{model_name}' is not in the catalog.")
    if model.sha256 and sha256.lower() != model.sha256:
        said = f"a file with sha256 {sha256}" if sha256 else "a file it did not name (mahout before 0.2.0)"
        raise WrongModelFile(
            f"The catalog's {model_name} is one file "
            f"({model.quantization or 'its quantisation'}, sha256 {model.sha256}); "
            f"this host benchmarked {said}. Serve that exact file (mahout add PATH.gguf checks one), or upgrade mahout."
        )
    figures = {
        "prompt_tps": float(benchmark["prompt_tps"]),
        "gen_tps": float(benchmark["gen_tps"]),
        "ttft_ms": float(benchmark["ttft_ms"]),
        "load_ms": float(benchmark.get("load_ms") or 0),
        "memory_mb": float(benchmark["memory_mb"]),
        "threads": int(benchmark.get("threads") or 0),
        "device": str(benchmark.get("device") or "cpu")[:100],
        "gpu_layers": int(benchmark.get("gpu_layers") or 0),
        "vram_mb": float(benchmark.get("vram_mb") or 0),
        "machine": machine,
        "sha256": sha256.lower(),
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
        "fingerprint": fingerprint,
        "paused": paused,
        "models_loaded": models_loaded,
        "version": version[:32],
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
    """Take the host out of maintenance (an operator may lift any); False if it was not in maintenance."""
    changed = Host.objects.filter(pk=host.pk, maintenance_since__isnull=False).update(
        maintenance_reason="", maintenance_since=None, maintenance_by=""
    )
    host.refresh_from_db(fields=["maintenance_reason", "maintenance_since", "maintenance_by"])
    return bool(changed)


# Who may set a maintenance its owner cannot lift: an operator, and a failed canary
# (`marketplace.lifecycle.canaries`). The reliability rule ("automatic") is the owner's to lift once
# the machine is fixed.
HELD_BY = frozenset({"operator", "verification"})


class HostBanned(DomainError):
    status = 403
    code = "host_banned"
    type = "permission_error"


class MaintenanceHeld(DomainError):
    status = 403
    code = "maintenance_held"
    type = "permission_error"


def owner_may_resume(host: Host) -> bool:
    """Whether the owner's page offers to lift this host's maintenance."""
    return host.banned_at is None and host.maintenance_since is not None and host.maintenance_by not in HELD_BY


def host_maintenance_resume_by_owner(*, host: Host) -> bool:
    """The owner lifts a maintenance; False if it was not in maintenance.

    A compare-and-set that excludes the maintenances only an operator lifts (`HELD_BY`)
    and banned hosts, so one set by an operator a moment ago is never lifted by a
    click on a page that did not show it yet: that raises MaintenanceHeld (or HostBanned).
    """
    changed = (
        Host.objects.filter(pk=host.pk, maintenance_since__isnull=False, banned_at__isnull=True)
        .exclude(maintenance_by__in=HELD_BY)
        .update(maintenance_reason="", maintenance_since=None, maintenance_by="")
    )
    host.refresh_from_db(
        fields=["maintenance_reason", "maintenance_since", "maintenance_by", "banned_at", "ban_reason"]
    )
    if changed:
        return True
    if host.banned_at is not None:
        raise HostBanned(f"{host.name} is banned by the operator: {host.ban_reason}")
    if host.maintenance_since is not None:
        raise MaintenanceHeld(
            f"Only an operator can lift this maintenance (set by {host.maintenance_by}); contact support."
        )
    return False


# --- bans and tokens ------------------------------------------------------------------------


def host_token_group(token_hash: str) -> str:
    """Every host socket opened with one token (named by its hash, as stored): told to close
    when the token is rotated or revoked. Keyed by the token, not the host, so a socket
    that joins while a rotation commits still hears of it (it joins before authenticating)."""
    return f"hosttoken.{token_hash}"


def _sockets_close_on_commit(token_hash: str, *, code: int) -> None:
    announce_on_commit(host_token_group(token_hash), {"type": "host.token_revoked", "code": code})


def owner_sockets_close(*, hosts: QuerySet[Host]) -> int:
    """Close every open socket of `hosts` (their owner was deactivated), after the commit.
    Returns how many hosts."""
    hashes = list(hosts.values_list("token_hash", flat=True))
    for token_hash in hashes:
        _sockets_close_on_commit(token_hash, code=4403)
    return len(hashes)


def revoked_token_hash() -> str:
    """A hash no token matches: that of a fresh secret nobody is ever shown."""
    return secret_hash(secret_new("revoked"))


class BanReasonMissing(ValueError):
    pass


@transaction.atomic
def host_ban(*, host: Host, reason: str, by: str) -> bool:
    """Ban a host: refused everywhere from now on, its token revoked, its open sockets closed.

    Under the host's row lock; an already banned host keeps its first ban (False). The
    token's hash is replaced by one nobody holds, so the old token answers 401 at once;
    `hosts.selectors.host_refusal` refuses a banned host besides. Nothing else changes:
    maintenance, pause and trust stay as they were; its running jobs are continued
    elsewhere when their pushes stop. The reason is shown to the owner, so it is required.
    """
    reason = reason.strip()[:300]
    if not reason:
        raise BanReasonMissing("A ban needs a reason the owner can read.")
    row = Host.objects.select_for_update().get(pk=host.pk)
    if row.banned_at is None:
        Host.objects.filter(pk=host.pk).update(
            banned_at=timezone.now(), ban_reason=reason, banned_by=by[:100], token_hash=revoked_token_hash()
        )
        _sockets_close_on_commit(row.token_hash, code=4403)
        logger.info("host %s banned by %s: %s", host.pk, by, reason)
    host.refresh_from_db(fields=["banned_at", "ban_reason", "banned_by", "token_hash"])
    return row.banned_at is None


def host_unban(*, host: Host, by: str) -> bool:
    """Lift a ban (operators only: no page of the owner calls this); False if it was not
    banned. The token stays revoked: the owner rotates it on their machines page to
    bring the machine back."""
    changed = Host.objects.filter(pk=host.pk, banned_at__isnull=False).update(
        banned_at=None, ban_reason="", banned_by=""
    )
    host.refresh_from_db(fields=["banned_at", "ban_reason", "banned_by"])
    if changed:
        logger.info("host %s unbanned by %s", host.pk, by)
    return bool(changed)


@transaction.atomic
def host_token_rotate(*, host: Host) -> NewHost:
    """Give the host a new token (returned once) and revoke the old one at once: its HTTP
    calls answer 401 from this commit on, and the sockets it opened are told to close.
    Refused for a banned host (HostBanned): only an operator brings it back."""
    row = Host.objects.select_for_update().get(pk=host.pk)
    if row.banned_at is not None:
        raise HostBanned(f"{row.name} is banned by the operator: {row.ban_reason}")
    token = secret_new("host")
    Host.objects.filter(pk=host.pk).update(token_hash=secret_hash(token), token_prefix=secret_prefix(token))
    _sockets_close_on_commit(row.token_hash, code=4401)
    host.refresh_from_db(fields=["token_hash", "token_prefix"])
    return NewHost(host=host, token=token)


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
    return {
        **names,
        "slots": slots,
        "active_jobs": active,
        "memory_budget_mb": budget if isinstance(budget, int) else None,
    }


def host_socket_opened(*, host_id: int) -> datetime:
    """Record that the host's WebSocket (re)opened; returns when, to compare with later."""
    now = timezone.now()
    Host.objects.filter(pk=host_id).update(socket_since=now)
    return now
