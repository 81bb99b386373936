"""Reads for hosts."""
from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db.models import Exists, OuterRef, QuerySet
from django.utils import timezone

from hosts.models import Host
from marketplace.models import Job
from marketplace.secrets import secret_hash


def host_by_token(*, token: str) -> Host | None:
    return Host.objects.filter(token_hash=secret_hash(token)).select_related("owner").first()


def qualified_model_ids(*, host: Host, fingerprint: str) -> list[int]:
    """Models this host benchmarked on the machine it is claiming from."""
    return list(
        host.qualifications.filter(fingerprint=fingerprint, model__active=True).values_list("model_id", flat=True)
    )


def with_running_job(queryset: QuerySet[Host]) -> QuerySet[Host]:
    """Annotate `has_running_job`, so a page listing many hosts gets their statuses in one query."""
    return queryset.annotate(
        has_running_job=Exists(Job.objects.filter(host=OuterRef("pk"), status=Job.Status.RUNNING))
    )


def host_status(*, host: Host) -> str:
    """offline, maintenance, paused, busy or online: the first that applies. A host from
    `with_running_job` is busy by its annotation; any other costs a query."""
    if host.last_heartbeat_at is None or timezone.now() - host.last_heartbeat_at > timedelta(
        seconds=settings.HOST_OFFLINE_AFTER_SECONDS
    ):
        return "offline"
    if host.maintenance_since is not None:
        return "maintenance"
    if host.paused:
        return "paused"
    running = getattr(host, "has_running_job", None)
    if running is None:
        running = Job.objects.filter(host=host, status=Job.Status.RUNNING).exists()
    if running:
        return "busy"
    return "online"


def host_earning_lines(*, host: Host, limit: int = 100) -> list[Job]:
    return list(
        Job.objects.filter(host=host, status=Job.Status.COMPLETED)
        .select_related("model")
        .order_by("-finished_at")[:limit]
    )


def host_active_jobs(*, host: Host) -> list[Job]:
    return list(Job.objects.filter(host=host, status=Job.Status.RUNNING).select_related("model"))


def host_qualifications(*, host: Host) -> list:
    return list(host.qualifications.select_related("model"))
