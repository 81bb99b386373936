"""Ring plans: a model served as a pipeline of layer-sliced stages on hosts.

A plan names a catalog model, its stages (contiguous [start, end) layer ranges covering
every layer exactly once, in order), each stage's host (none: the bridge host runs it),
and the row width and micro-batch every stage is built for, declared up front. Stages
report where they listen (their upstream neighbour and the bridge dial them there) and
where their time went; the plan shows both. The plan's `secret` never leaves the gateway:
each link of the ring has its own secret derived from it (`selectors.link_secret`), handed to
that link's two ends only (`mahout.link`, `mahout.ring.keys`).

A `RingLinkDispute` records two hosts whose evidence of one link disagreed in a ring
inquiry when the inquiry could not tell which of them lied: neither forfeits anything for
it, the ring is retired, and no new plan puts the two next to each other for
`DISPUTE_AVOID_DAYS` (`services.ring_link_dispute_record`).
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
        "hosts.Host",
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="bridged_rings",
        help_text="the host whose bridge feeds this ring (none for a local ring)",
    )
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.ACTIVE)
    created_at = models.DateTimeField(auto_now_add=True)
    secret = models.CharField(
        max_length=100,
        default=link_secret_new,
        editable=False,
        help_text="what each of the ring's link secrets is derived from; never handed out",
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
        max_length=300,
        blank=True,
        default="",
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


class RingLinkDispute(models.Model):
    """Two hosts at the two ends of a ring's link whose evidence disagreed, where the inquiry
    could not tell which lied (`marketplace.trust.ring_inquiries`): no forfeit for it, the pair
    kept apart. `upstream_host` sent on the link (a stage, or the bridge), `downstream_host`
    received."""

    plan = models.ForeignKey(RingPlan, on_delete=models.CASCADE, related_name="disputes")
    upstream_index = models.IntegerField(help_text="the sending stage's index (-1: the bridge)")
    downstream_index = models.PositiveIntegerField()
    upstream_host = models.ForeignKey("hosts.Host", on_delete=models.CASCADE, related_name="+")
    downstream_host = models.ForeignKey("hosts.Host", on_delete=models.CASCADE, related_name="+")
    reason = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["upstream_host", "downstream_host", "created_at"], name="ring_dispute_pair")]

    def __str__(self) -> str:
        return f"{self.plan} · link {self.upstream_index} -> {self.downstream_index} disputed"
