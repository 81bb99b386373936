"""Host machines, their tokens, and the models they qualified on their hardware."""
from __future__ import annotations

from django.conf import settings
from django.db import models


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
    maintenance_reason = models.CharField(max_length=300, blank=True)
    maintenance_since = models.DateTimeField(null=True, blank=True)
    maintenance_by = models.CharField(max_length=100, blank=True, help_text="who put it in maintenance, e.g. operator")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["owner", "name"], name="host_name_unique_per_owner"),
            models.CheckConstraint(
                condition=models.Q(maintenance_since__isnull=True) | ~models.Q(maintenance_reason=""),
                name="host_maintenance_has_reason",
            ),
        ]

    def __str__(self) -> str:
        return self.name


class Qualification(models.Model):
    """Proof that a host benchmarked a model on one machine (its fingerprint).

    A host may claim a model only with a qualification whose fingerprint is
    the machine it claims from: a catalog entry or a build is not enough.
    """

    host = models.ForeignKey(Host, on_delete=models.CASCADE, related_name="qualifications")
    model = models.ForeignKey("marketplace.CatalogModel", on_delete=models.PROTECT, related_name="qualifications")
    fingerprint = models.CharField(max_length=64)
    prompt_tps = models.FloatField()
    gen_tps = models.FloatField()
    ttft_ms = models.FloatField()
    memory_mb = models.FloatField()
    threads = models.PositiveIntegerField(default=0)
    machine = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["host", "model", "fingerprint"], name="one_qualification_per_machine"),
            models.CheckConstraint(condition=models.Q(gen_tps__gt=0), name="qualification_measured"),
        ]

    def __str__(self) -> str:
        return f"{self.host} · {self.model} · {self.fingerprint[:8]}"
