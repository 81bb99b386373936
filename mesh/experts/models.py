"""The expert market: MoE models, their coordinators' saturation, and the volunteer workers
that cover (layer, expert-range) slices of them.

A model's experts are cut into slices of `slice_size` experts per layer (read from its
GGUF metadata when it is registered, so demand exists before any worker does). Each slice
wants `effective_target` replicas: `base_target` while the coordinator is quiet,
`base_target + boost` while it reports saturation. A worker row is handed out by the
volunteer endpoint (ASSIGNED), becomes ACTIVE when the worker registers where it can be
reached, and RETIRED when it stops heartbeating, is no longer needed, leaves (its owner came
back), when its model's coordinator went silent, or when that coordinator blames it (a
recomputed batch disagreed: `blamed_at`, `blame_reason`); `retired_reason` says which. Each
worker has its own `secret`, handed to its volunteer and to its model's coordinator (the one
the operator bound, `coordinator`): the coordinator's link to it is admitted with it
(`mahout.link`). `checks_passed` counts its batches the coordinator recomputed and found
equal: a volunteer host that is not trusted is checked at the probation share until its
workers have passed `MOE_PROBATION_CHECKS` (`mesh.experts.selectors.dispatch_map`).
"""

from __future__ import annotations

from django.db import models
from django.db.models import Q

from mesh.linksecret import link_secret_new

__all__ = ["ExpertModel", "ExpertWorker"]


class ExpertModel(models.Model):
    name = models.CharField(max_length=200, unique=True)
    gguf_path = models.CharField(max_length=1000, help_text="the model file the gateway cuts slices from")
    arch = models.CharField(max_length=64)
    n_layers = models.PositiveIntegerField()
    n_experts = models.PositiveIntegerField(help_text="from the GGUF's expert_count")
    n_experts_used = models.PositiveIntegerField(help_text="from the GGUF's expert_used_count")
    slice_size = models.PositiveIntegerField(default=4, help_text="experts per slice handed to a volunteer")
    base_target = models.PositiveIntegerField(default=0, help_text="replicas per slice while the coordinator is quiet")
    boost = models.PositiveIntegerField(default=1, help_text="extra replicas per slice while it is saturated")
    saturation_threshold = models.PositiveIntegerField(default=2, help_text="busy slots that mean saturated")
    coordinator = models.ForeignKey(
        "hosts.Host",
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="coordinated_moe_models",
        help_text="bound by the operator (moe_register --coordinator-host); no other host may report for the model",
    )
    busy = models.PositiveIntegerField(default=0, help_text="busy slots in the coordinator's last report")
    saturated = models.BooleanField(default=False)
    reported_at = models.DateTimeField(null=True, blank=True)
    last_saturated_at = models.DateTimeField(null=True, blank=True)
    silent_since = models.DateTimeField(
        null=True,
        blank=True,
        help_text=(
            "when the control plane's loop found no fresh report from its coordinator; cleared by its next report"
        ),
    )
    last_engaged_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="when its coordinator last reported experts computed by its workers on merit",
    )
    excused_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text=(
            "when a failed audit of its coordinator was excused because its workers computed part "
            "of that answer; every batch of its workers is then recomputed for MOE_EXCUSE_SECONDS"
        ),
    )
    remote_unused_since = models.DateTimeField(
        null=True,
        blank=True,
        help_text="since when its coordinator, saturated, has measured its workers and sent them nothing but probes "
        "(computing here beat their round trips): the boost is held back; cleared once it engages one",
    )

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=Q(n_layers__gt=0) & Q(n_experts__gt=0) & Q(slice_size__gt=0) & Q(saturation_threshold__gt=0),
                name="expert_model_sizes_positive",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} · {self.n_layers} layers x {self.n_experts} experts"


class ExpertWorker(models.Model):
    class Status(models.TextChoices):
        ASSIGNED = "assigned"  # handed a slice; downloading it
        ACTIVE = "active"  # registered and heartbeating
        RETIRED = "retired"

    model = models.ForeignKey(ExpertModel, on_delete=models.CASCADE, related_name="workers")
    host = models.ForeignKey("hosts.Host", on_delete=models.PROTECT, related_name="expert_workers")
    layer = models.PositiveIntegerField()
    first = models.PositiveIntegerField()
    count = models.PositiveIntegerField()
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.ASSIGNED)
    address = models.CharField(
        max_length=200, blank=True, help_text="host:port when directly reachable; blank: relay only"
    )
    last_serve_ms = models.BigIntegerField(default=0, help_text="epoch ms of the last batch it computed; 0 = never")
    assigned_at = models.DateTimeField(auto_now_add=True)
    registered_at = models.DateTimeField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    retired_at = models.DateTimeField(null=True, blank=True)
    secret = models.CharField(
        max_length=100,
        default=link_secret_new,
        editable=False,
        help_text="what the coordinator's link to this worker is admitted with; its volunteer and the coordinator only",
    )
    blamed_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="when its model's coordinator reported that its values disagreed with a recompute",
    )
    blame_reason = models.CharField(
        max_length=500, blank=True, help_text="the coordinator's account of the disagreement"
    )
    retired_reason = models.CharField(max_length=200, blank=True, help_text="why it retired, in a few words")
    checks_passed = models.PositiveIntegerField(
        default=0,
        help_text="its batches the coordinator recomputed and found equal (as the coordinator last reported)",
    )

    class Meta:
        ordering = ["model", "layer", "first", "id"]
        constraints = [models.CheckConstraint(condition=Q(count__gt=0), name="expert_worker_slice_not_empty")]
        indexes = [models.Index(fields=["model", "status"])]

    def __str__(self) -> str:
        return (
            f"{self.model.name} · layer {self.layer} experts [{self.first}, {self.first + self.count}) · {self.status}"
        )
