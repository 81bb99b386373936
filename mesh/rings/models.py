"""Ring plans: a model served as a pipeline of layer-sliced stages on hosts.

A plan names a catalog model, its stages (contiguous [start, end) layer ranges covering
every layer exactly once, in order), each stage's host (none: the bridge host runs it),
and the row width and micro-batch every stage is built for, declared up front. Stages
report where they listen (their upstream neighbour and the bridge dial them there) and
where their time went; the plan shows both. The plan's `secret` admits its stages and its
bridge to each other's links (`mahout.link`); only the ring's participants are handed it.
"""
from __future__ import annotations

from django.db import models
from django.db.models import F, Q

from mesh.linksecret import link_secret_new


class ModelLayout(models.Model):
    """How many transformer layers a catalog model has (read from its GGUF's block_count):
    the authority a plan's ranges are checked against."""

    model = models.OneToOneField("catalog.CatalogModel", on_delete=models.CASCADE, related_name="layout")
    n_layers = models.PositiveIntegerField()

    class Meta:
        constraints = [models.CheckConstraint(condition=Q(n_layers__gt=0), name="layout_has_layers")]

    def __str__(self) -> str:
        return f"{self.model} · {self.n_layers} layers"


class RingPlan(models.Model):
    class Status(models.TextChoices):
        ACTIVE = "active"
        RETIRED = "retired"

    model = models.ForeignKey("catalog.CatalogModel", on_delete=models.PROTECT, related_name="ring_plans")
    n_layers = models.PositiveIntegerField(help_text="the model's layer count when the plan was made")
    row_width = models.PositiveIntegerField(help_text="most tokens one row of a pass may carry")
    micro_batch = models.PositiveIntegerField(help_text="most rows one pass may carry")
    bridge_host = models.ForeignKey(
        "hosts.Host", on_delete=models.PROTECT, null=True, blank=True, related_name="bridged_rings",
        help_text="the host whose bridge feeds this ring (none for a local ring)",
    )
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.ACTIVE)
    created_at = models.DateTimeField(auto_now_add=True)
    secret = models.CharField(
        max_length=100, default=link_secret_new, editable=False,
        help_text="what the ring's links are admitted with; handed to its stage hosts and its bridge only",
    )

    class Meta:
        constraints = [
            models.CheckConstraint(condition=Q(row_width__gt=0) & Q(micro_batch__gt=0), name="ring_widths_positive"),
        ]

    def __str__(self) -> str:
        return f"ring {self.pk} · {self.model}"


class RingStage(models.Model):
    """Layers [start, end) of a plan, on one host, with the time use it last reported."""

    plan = models.ForeignKey(RingPlan, on_delete=models.CASCADE, related_name="stages")
    index = models.PositiveIntegerField()
    start = models.PositiveIntegerField()
    end = models.PositiveIntegerField()
    host = models.ForeignKey("hosts.Host", on_delete=models.PROTECT, null=True, blank=True, related_name="ring_stages")
    hold_s = models.FloatField(default=0.0, help_text="seconds spent holding a batch")
    idle_s = models.FloatField(default=0.0, help_text="seconds with nothing to do")
    queue_depth = models.PositiveIntegerField(default=0)
    batches = models.PositiveBigIntegerField(default=0)
    reported_at = models.DateTimeField(null=True, blank=True)
    address = models.CharField(
        max_length=300, blank=True, default="",
        help_text="HOST:PORT the stage's agent listens on, as it last reported (its upstream dials it)",
    )
    address_reported_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["plan", "index"]
        constraints = [
            models.UniqueConstraint(fields=["plan", "index"], name="one_stage_per_index"),
            models.CheckConstraint(condition=Q(start__lt=F("end")), name="stage_range_not_empty"),
        ]

    def __str__(self) -> str:
        return f"{self.plan} · stage {self.index} [{self.start}, {self.end})"
