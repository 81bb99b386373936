from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest

from mesh.rings.models import ModelLayout, RingLinkDispute, RingPlan, RingStage


class RingStageInline(admin.TabularInline):
    model = RingStage
    extra = 0
    readonly_fields = ("hold_s", "idle_s", "queue_depth", "batches", "reported_at", "address", "address_reported_at")


@admin.register(RingPlan)
class RingPlanAdmin(admin.ModelAdmin):
    """Plans are made through `mesh.rings.services.ring_plan_create` (it validates the ranges);
    the admin shows them and can retire one."""

    list_display = ("id", "model", "n_layers", "row_width", "micro_batch", "bridge_host", "status", "created_at")
    list_filter = ("status", "model")
    readonly_fields = ("model", "n_layers", "row_width", "micro_batch", "bridge_host", "created_at")
    inlines = [RingStageInline]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False


@admin.register(RingStage)
class RingStageAdmin(admin.ModelAdmin):
    list_display = (
        "plan",
        "index",
        "start",
        "end",
        "host",
        "address",
        "hold_s",
        "idle_s",
        "queue_depth",
        "reported_at",
    )
    list_filter = ("plan",)
    readonly_fields = (
        "plan",
        "index",
        "start",
        "end",
        "hold_s",
        "idle_s",
        "queue_depth",
        "batches",
        "reported_at",
        "address",
        "address_reported_at",
    )


@admin.register(ModelLayout)
class ModelLayoutAdmin(admin.ModelAdmin):
    list_display = ("model", "n_layers")


@admin.register(RingLinkDispute)
class RingLinkDisputeAdmin(admin.ModelAdmin):
    """Disputed links (`mesh.rings.services.ring_link_dispute_record`): the two hosts are not put
    at the ends of one link again for a while; neither forfeited anything. Read-only: an
    operator may delete one to let the pair be neighbours again."""

    list_display = ("created_at", "plan", "upstream_index", "downstream_index", "upstream_host", "downstream_host")
    readonly_fields = (
        "plan",
        "upstream_index",
        "downstream_index",
        "upstream_host",
        "downstream_host",
        "reason",
        "created_at",
    )

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False
