"""Deliberate redundancy (seed 001's next milestone; seed 002 keeps latency-critical models
on at least two workers): the gateway keeps each latency-critical model warm on
REDUNDANT_WARM_HOSTS hosts, so the host that continues a dead one's answer starts at once.

It speaks through the heartbeat's answer. When a latency-critical model has fewer warm
hosts than that (counting hosts already asked and still loading), the heartbeat of an idle
host qualified for it on this machine answers ``load: [model]``, and the host is recorded
as asked (`Host.warm_asked`, shown on the pool page). An ask that is not honoured within
WARM_ASK_SECONDS lapses, so another host can be asked. Once more hosts are warm than needed
(the dead one came back), an asked host is answered ``unload: [model]`` and released.
One ask per host at a time; a host that is busy, paused, in maintenance or banned, or whose
catalog is stale (it cannot say what it loaded), is never asked.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings

from catalog.models import CatalogModel
from hosts.models import Host
from hosts.selectors import REDUNDANT_WARM_HOSTS, qualified_model_ids, warm_host_counts
from marketplace.models import Job


def heartbeat_asks(*, host: Host, now: datetime) -> dict[str, list[str]]:
    """What this heartbeat's answer asks the host to load or unload (both lists, often empty)."""
    if host.warm_asked_id is not None:
        return _asked(host=host, now=now)
    critical = dict(CatalogModel.objects.filter(latency_critical=True, active=True).values_list("pk", "name"))
    if not critical or not _may_be_asked(host=host, now=now):
        return {"load": [], "unload": []}
    qualified = set(qualified_model_ids(host=host, fingerprint=host.fingerprint))
    wanted = [(pk, name) for pk, name in critical.items() if pk in qualified and not host.warm_for(name, now)]
    if not wanted or Job.objects.filter(host=host, status=Job.Status.RUNNING).exists():
        return {"load": [], "unload": []}
    counts = warm_host_counts(now=now)
    for model_id, name in wanted:
        if (
            counts.get(model_id, {}).get("warm", 0) + _loading(model_id=model_id, name=name, now=now)
            >= REDUNDANT_WARM_HOSTS
        ):
            continue
        if Host.objects.filter(pk=host.pk, warm_asked__isnull=True).update(warm_asked_id=model_id, warm_asked_at=now):
            return {"load": [name], "unload": []}
    return {"load": [], "unload": []}


def _may_be_asked(*, host: Host, now: datetime) -> bool:
    return not (host.paused or host.maintenance_since or host.banned_at) and host.catalog_fresh(now)


def _loading(*, model_id: int, name: str, now: datetime) -> int:
    """Hosts asked to load the model, still within their time, that do not report it loaded yet."""
    asked = Host.objects.online(now).filter(
        warm_asked_id=model_id, warm_asked_at__gte=now - timedelta(seconds=settings.WARM_ASK_SECONDS)
    )
    return sum(1 for other in asked if not other.warm_for(name, now))


def _asked(*, host: Host, now: datetime) -> dict[str, list[str]]:
    """A host already asked: keep it warm while it is needed; release it when it is not
    (answering ``unload``), or when it did not load in time."""
    assert host.warm_asked_id is not None  # (heartbeat_asks asks it only then)
    model = CatalogModel.objects.get(pk=host.warm_asked_id)
    loaded = host.catalog_fresh(now) and host.warm_for(model.name, now)
    if loaded:
        warm = warm_host_counts(now=now).get(model.pk, {}).get("warm", 0)
        if (
            model.latency_critical
            and model.active
            and warm <= REDUNDANT_WARM_HOSTS
            and _may_be_asked(host=host, now=now)
        ):
            return {"load": [], "unload": []}
        _release(host)
        return {"load": [], "unload": [model.name]}
    if host.warm_asked_at is None or now - host.warm_asked_at > timedelta(seconds=settings.WARM_ASK_SECONDS):
        _release(host)  # it never loaded it (no room, or it went away): another host may be asked
        return {"load": [], "unload": []}
    return {"load": [model.name], "unload": []}  # still loading: the ask stands


def _release(host: Host) -> None:
    Host.objects.filter(pk=host.pk).update(warm_asked=None, warm_asked_at=None)
    host.warm_asked_id, host.warm_asked_at = None, None


def warming_hosts(*, now: datetime) -> list[dict]:
    """Hosts asked to keep a model warm, for the pool page: loading, or warm for redundancy."""
    rows = (
        Host.objects.filter(warm_asked__isnull=False)
        .select_related("warm_asked", "owner")
        .order_by("warm_asked_at", "pk")
    )
    return [
        {
            "host": host,
            "model": host.warm_asked.name,
            "since": host.warm_asked_at,
            "state": "warm" if host.catalog_fresh(now) and host.warm_for(host.warm_asked.name, now) else "loading",
        }
        for host in rows
        if host.warm_asked is not None  # (always: the query asked for these)
    ]
