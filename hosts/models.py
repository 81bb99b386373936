"""Host machines, their tokens, and the models they qualified on their hardware."""
from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, models
from django.utils import timezone


class HostQuerySet(models.QuerySet):
    """The one place that says which hosts count as connected and online."""

    def connected(self, now: datetime | None = None) -> HostQuerySet:
        """Heard from within HOST_OFFLINE_AFTER_SECONDS."""
        return self.filter(last_heartbeat_at__gte=connected_since(now or timezone.now()))

    def online(self, now: datetime | None = None) -> HostQuerySet:
        """Connected, not paused, not in maintenance, not banned: may be offered work."""
        return self.connected(now).filter(paused=False, maintenance_since__isnull=True, banned_at__isnull=True)

    def trusted(self) -> HostQuerySet:
        """Out of probation (see `marketplace.reputation`) and not banned."""
        return self.filter(trusted_at__isnull=False, banned_at__isnull=True)

    def qualified_for(self, model: object) -> HostQuerySet:
        return self.filter(qualifications__model=model)


class Host(models.Model):
    """A machine running mahout. Its token is stored only as a hash.

    A host in maintenance (`maintenance_since` set, always with a reason its owner
    can read) claims no work until it is resumed; its running job still finishes.
    """

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="hosts")
    name = models.CharField(max_length=100)
    token_prefix = models.CharField(max_length=16)
    token_hash = models.CharField(max_length=64, unique=True)
    paused = models.BooleanField(default=False)
    fingerprint = models.CharField(max_length=64, blank=True)
    version = models.CharField(max_length=32, blank=True)
    models_loaded = models.JSONField(default=list, blank=True)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    catalog = models.JSONField(
        default=dict, blank=True, help_text="last readable catalog: installed, qualified, loaded, slots, active_jobs"
    )
    catalog_at = models.DateTimeField(null=True, blank=True, help_text="when a readable catalog last arrived")
    slots = models.PositiveSmallIntegerField(default=1, help_text="jobs the host runs at once (from its catalog)")
    routing_weight = models.FloatField(
        null=True, blank=True, help_text="operator override of the weighted strategy's weight (default: measured tokens/s)"
    )
    socket_since = models.DateTimeField(null=True, blank=True, help_text="when its current WebSocket (presence, batches) opened")
    maintenance_reason = models.CharField(max_length=300, blank=True)
    maintenance_since = models.DateTimeField(null=True, blank=True)
    maintenance_by = models.CharField(max_length=100, blank=True, help_text="who put it in maintenance, e.g. operator")
    trusted_at = models.DateTimeField(
        null=True, blank=True, help_text="when it left probation (enough canaries passed and jobs done); cleared by a failure"
    )
    measured_tps = models.FloatField(
        null=True, blank=True, help_text="tokens/s the gateway measured on its own jobs (moving average), not reported"
    )
    banned_at = models.DateTimeField(null=True, blank=True, help_text="operator ban: refused everywhere; only an operator lifts it")
    ban_reason = models.CharField(max_length=300, blank=True)
    banned_by = models.CharField(max_length=100, blank=True)
    warm_asked = models.ForeignKey(
        "catalog.CatalogModel", null=True, blank=True, on_delete=models.SET_NULL, related_name="+",
        help_text="a latency-critical model the gateway asked this idle host to keep loaded (deliberate redundancy)",
    )
    warm_asked_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = HostQuerySet.as_manager()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["owner", "name"], name="host_name_unique_per_owner"),
            models.CheckConstraint(
                condition=models.Q(maintenance_since__isnull=True) | ~models.Q(maintenance_reason=""),
                name="host_maintenance_has_reason",
            ),
            models.CheckConstraint(
                condition=models.Q(banned_at__isnull=True) | ~models.Q(ban_reason=""), name="host_ban_has_reason"
            ),
        ]

    def __str__(self) -> str:
        return self.name

    def is_connected(self, now: datetime) -> bool:
        return self.last_heartbeat_at is not None and self.last_heartbeat_at >= connected_since(now)

    def catalog_fresh(self, now: datetime) -> bool:
        """Whether the host's catalog can be trusted to say what is loaded."""
        return catalog_fresh(self.catalog_at, now)

    def warm_for(self, model_name: str, now: datetime) -> bool:
        """Warm (its fresh catalog says the model is loaded) or possibly warm (no fresh
        catalog): a host whose catalog cannot be read never counts as cold."""
        return is_warm(catalog=self.catalog, catalog_at=self.catalog_at, model_name=model_name, now=now)


def connected_since(now: datetime) -> datetime:
    return now - timedelta(seconds=settings.HOST_OFFLINE_AFTER_SECONDS)


def online_sql(*, alias: str, now: datetime) -> tuple[str, list]:
    """`HostQuerySet.online` as SQL conditions on the host table under `alias` (with their
    parameters), for the plain statement routing runs on every admission; a test holds the
    two forms to the same hosts."""
    at = connection.ops.adapt_datetimefield_value(connected_since(now))
    return (
        f"{alias}.last_heartbeat_at >= %s AND {alias}.paused = %s AND {alias}.maintenance_since IS NULL"
        f" AND {alias}.banned_at IS NULL",
        [at, False],
    )


def catalog_fresh(catalog_at: datetime | None, now: datetime) -> bool:
    return catalog_at is not None and now - catalog_at <= timedelta(seconds=settings.CATALOG_STALE_SECONDS)


def is_warm(*, catalog: dict | None, catalog_at: datetime | None, model_name: str, now: datetime) -> bool:
    """The warm rule, for a host row or for its columns read in bulk."""
    return not catalog_fresh(catalog_at, now) or model_name in ((catalog or {}).get("loaded") or [])


class Qualification(models.Model):
    """Proof that a host benchmarked a model on one machine (its fingerprint).

    A host may claim a model only with a qualification whose fingerprint is
    the machine it claims from: a catalog entry or a build is not enough.
    """

    host = models.ForeignKey(Host, on_delete=models.CASCADE, related_name="qualifications")
    model = models.ForeignKey("catalog.CatalogModel", on_delete=models.PROTECT, related_name="qualifications")
    fingerprint = models.CharField(max_length=64)
    prompt_tps = models.FloatField()
    gen_tps = models.FloatField()
    ttft_ms = models.FloatField()
    load_ms = models.FloatField(default=0, help_text="how long loading the model took in the benchmark (0: not reported)")
    memory_mb = models.FloatField()
    threads = models.PositiveIntegerField(default=0)
    machine = models.JSONField(default=dict, blank=True)
    sha256 = models.CharField(max_length=64, blank=True, help_text="the file benchmarked (the catalog's pin)")
    device = models.CharField(max_length=100, default="cpu", help_text='where it ran: "cpu" or the GPU\'s name')
    gpu_layers = models.PositiveIntegerField(default=0, help_text="layers offloaded to the GPU")
    vram_mb = models.FloatField(default=0, help_text="GPU memory its layers take")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["host", "model", "fingerprint"], name="one_qualification_per_machine"),
            models.CheckConstraint(condition=models.Q(gen_tps__gt=0), name="qualification_measured"),
        ]

    def __str__(self) -> str:
        return f"{self.host} · {self.model} · {self.fingerprint[:8]}"
