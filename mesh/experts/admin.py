"""Admin for the expert market: MoE models (targets and the coordinator's last report) and
their volunteer workers. Models are registered with `manage.py moe_register` (it reads the
GGUF); the admin tunes targets and shows state, which the market itself writes."""

from __future__ import annotations

from django.contrib import admin
from django.db.models import Model
from django.http import HttpRequest

from mesh.experts.models import ExpertModel, ExpertWorker


class ExpertWorkerInline(admin.TabularInline):
    model = ExpertWorker
    extra = 0
    fields = (
        "host",
        "layer",
        "first",
        "count",
        "status",
        "address",
        "last_serve_ms",
        "checks_passed",
        "heartbeat_at",
        "retired_reason",
    )
    readonly_fields = fields
    can_delete = False

    def has_add_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False


@admin.register(ExpertModel)
class ExpertModelAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "arch",
        "n_layers",
        "n_experts",
        "slice_size",
        "base_target",
        "boost",
        "coordinator",
        "busy",
        "saturated",
        "reported_at",
        "silent_since",
    )
    list_filter = ("saturated", "arch")
    search_fields = ("name",)
    readonly_fields = (
        "name",
        "gguf_path",
        "arch",
        "n_layers",
        "n_experts",
        "n_experts_used",
        "coordinator",
        "busy",
        "saturated",
        "reported_at",
        "last_saturated_at",
        "silent_since",
    )
    inlines = [ExpertWorkerInline]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # registration reads the GGUF: manage.py moe_register


@admin.register(ExpertWorker)
class ExpertWorkerAdmin(admin.ModelAdmin):
    list_display = (
        "id",
        "model",
        "host",
        "layer",
        "first",
        "count",
        "status",
        "address",
        "last_serve_ms",
        "heartbeat_at",
        "retired_reason",
        "blamed_at",
    )
    list_filter = ("status", "model")
    readonly_fields = (
        "model",
        "host",
        "layer",
        "first",
        "count",
        "status",
        "address",
        "last_serve_ms",
        "assigned_at",
        "registered_at",
        "heartbeat_at",
        "retired_at",
        "retired_reason",
        "checks_passed",
        "blamed_at",
        "blame_reason",
    )

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # workers are handed out by the volunteer endpoint
