"""Host machines, their tokens, and the models they qualified on their hardware."""
from __future__ import annotations

from django.conf import settings
from django.db import models


class Host(models.Model):
    """A machine running mahout. Its token is stored only as a hash."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="hosts")
    name = models.CharField(max_length=100)
    token_prefix = models.CharField(max_length=16)
    token_hash = models.CharField(max_length=64, unique=True)
    paused = models.BooleanField(default=False)
    fingerprint = models.CharField(max_length=64, blank=True)
    version = models.CharField(max_length=32, blank=True)
    models_loaded = models.JSONField(default=list, blank=True)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["owner", "name"], name="host_name_unique_per_owner")]

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
