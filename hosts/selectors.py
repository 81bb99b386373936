"""Reads for hosts: authentication, qualifications, and which hosts are online and warm."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING

from django.conf import settings
from django.utils import timezone

from catalog.models import CatalogModel
from core.errors import ApiError
from core.secrets import secret_hash
from hosts.models import Host, HostAllowance, Qualification, is_warm

if TYPE_CHECKING:
    from django.contrib.auth.models import User


def host_by_token(*, token: str) -> Host | None:
    return Host.objects.filter(token_hash=secret_hash(token)).select_related("owner").first()


def machines_allowed(owner: User) -> int:
    """How many machines the owner's account may register: an operator's allowance, else HOSTS_PER_ACCOUNT."""
    allowance = HostAllowance.objects.filter(owner=owner).values_list("machines", flat=True).first()
    return settings.HOSTS_PER_ACCOUNT if allowance is None else allowance


def invalid_host_token() -> ApiError:
    return ApiError(401, "Invalid host token.", code="invalid_host_token", type="authentication_error")


def host_refusal(host: Host) -> ApiError | None:
    """Why a host whose token is valid is refused anyway (a 403), or None.

    A ban revokes the token (`services.host_ban`), so a banned host's old token already
    answers 401; this check holds the ban wherever else `banned_at` gets set without a new
    hash, and it is the one rule for every door (HTTP, the host socket). A host whose owner's
    account is deactivated is refused until an operator reactivates the account.
    """
    if host.banned_at is not None:
        return ApiError(
            403, f"This host is banned by the operator: {host.ban_reason}", code="host_banned", type="permission_error"
        )
    if not host.owner.is_active:
        return ApiError(
            403,
            "This host's owner account is deactivated; its hosts are refused until an operator reactivates it.",
            code="owner_inactive",
            type="permission_error",
        )
    return None


def host_from_secret(secret: str) -> Host:
    """The host a bearer token belongs to: a 401 for an unknown (or revoked) token, a 403
    for a banned host or one whose owner is inactive, in the API's format."""
    host = host_by_token(token=secret)
    if host is None:
        raise invalid_host_token()
    refusal = host_refusal(host)
    if refusal is not None:
        raise refusal
    return host


def host_for_socket(*, host_id: int, token_hash: str) -> Host:
    """The host of an open socket, re-read, refused as its token would be refused now: a
    socket opened with a token that was since rotated or revoked answers 401 (its close
    message may still be on the way), a host banned or an owner deactivated since, 403."""
    host = Host.objects.select_related("owner").filter(pk=host_id, token_hash=token_hash).first()
    if host is None:
        raise invalid_host_token()
    refusal = host_refusal(host)
    if refusal is not None:
        raise refusal
    return host


def qualified_model_ids(*, host: Host, fingerprint: str) -> list[int]:
    """Models this host benchmarked on the machine it is claiming from."""
    return list(
        host.qualifications.filter(fingerprint=fingerprint, model__active=True).values_list("model_id", flat=True)
    )


def host_qualifications(*, host: Host) -> list:
    return list(host.qualifications.select_related("model"))


def warm_model_ids(*, host: Host, model_ids: list[int], now: datetime | None = None) -> list[int]:
    """Of `model_ids` (the host's qualified models), those it is warm (or possibly warm) for."""
    now = now or timezone.now()
    if not host.catalog_fresh(now):
        return list(model_ids)
    names = dict(CatalogModel.objects.filter(pk__in=model_ids).values_list("pk", "name"))
    return [model_id for model_id in model_ids if host.warm_for(names.get(model_id, ""), now)]


def warm_host_counts(*, now: datetime | None = None, model_id: int | None = None) -> dict[int, dict[str, int]]:
    """Per catalog model id: hosts online and qualified, and how many of them are warm
    (or possibly warm); with `model_id`, that model's alone."""
    now = now or timezone.now()
    online = Host.objects.online(now)
    qualified = Qualification.objects.filter(host__in=online, model__active=True)
    rows = (
        (qualified if model_id is None else qualified.filter(model_id=model_id))
        .values_list("model_id", "model__name", "host_id", "host__catalog", "host__catalog_at")
        .distinct()
    )
    counts: dict[int, dict[str, int]] = {}
    seen: set[tuple[int, int]] = set()
    for model_id, name, host_id, catalog, catalog_at in rows:
        if (model_id, host_id) in seen:
            continue
        seen.add((model_id, host_id))
        entry = counts.setdefault(model_id, {"online": 0, "warm": 0})
        entry["online"] += 1
        if is_warm(catalog=catalog, catalog_at=catalog_at, model_name=name, now=now):
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


def client_too_old(version: str) -> str | None:
    """Why a mahout reporting `version` may not serve here (older than
    `MAHOUT_MIN_VERSION`, or no version at all), or None. A version that does not parse
    (none, "sim") cannot be held to the minimum, so it is refused like an old one,
    except where MAHOUT_UNVERSIONED_ALLOWED lets the tests' synthetic hosts in."""
    from packaging.version import InvalidVersion, Version

    try:
        reported = Version(version)
    except InvalidVersion:
        if settings.MAHOUT_UNVERSIONED_ALLOWED:
            return None
        return (
            f"mahout's version {version!r} is not a version (mahout "
            f"sends its own, e.g. {settings.MAHOUT_MIN_VERSION}); "
            f"only mahout {settings.MAHOUT_MIN_VERSION} or newer serves here"
        )
    if reported >= Version(settings.MAHOUT_MIN_VERSION):
        return None
    return f"mahout {version} is older than {settings.MAHOUT_MIN_VERSION}, the oldest this gateway serves with"
