"""The marketplace in the admin: the catalog with its warm hosts, requests and jobs.
Prompts and delivered text stay out."""
from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse

from catalog.models import CatalogModel
from catalog.money import usd
from hosts import selectors as hosts
from hosts.admin import HostAdmin
from hosts.models import Host
from marketplace import selectors, services
from marketplace.canaries import canary_summary
from marketplace.models import CanaryCheck, CanaryReference, Job, Request, StageShare, TextChunk


@admin.register(Host)
class HostWithStatusAdmin(HostAdmin):
    """The host admin, with each host's status (busy means it is running a job)."""

    def get_queryset(self, request: HttpRequest) -> QuerySet[Host]:
        return selectors.with_running_job(super().get_queryset(request))

    @admin.display(description="status")
    def status(self, host: Host) -> str:
        return selectors.host_status(host=host)

    def host_ban(self, *, host: Host, reason: str, by: str) -> bool:
        return services.host_ban_with_consequences(host=host, reason=reason, by=by)


@admin.register(CatalogModel)
class CatalogModelAdmin(admin.ModelAdmin):
    list_display = (
        "name", "kind", "context_length", "input_price_ucents", "output_price_ucents", "routing_strategy",
        "latency_critical", "warm_hosts", "active",
    )
    list_filter = ("kind", "active", "latency_critical", "routing_strategy")
    search_fields = ("name",)

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        self._counts = hosts.warm_host_counts()
        for model, warm in hosts.under_redundant_models(counts=self._counts):
            self.message_user(
                request, f"Latency-critical model {model.name} has {warm} warm host(s); keep at least "
                f"{hosts.REDUNDANT_WARM_HOSTS} so a failover lands on a warm host.", level=messages.WARNING,
            )
        return super().changelist_view(request, extra_context)

    @admin.display(description="warm / online hosts")
    def warm_hosts(self, obj: CatalogModel) -> str:
        entry = getattr(self, "_counts", {}).get(obj.pk, {"warm": 0, "online": 0})
        flag = " ⚠" if obj.latency_critical and entry["warm"] < hosts.REDUNDANT_WARM_HOSTS else ""
        return f"{entry['warm']} / {entry['online']}{flag}"


class JobInline(admin.TabularInline):
    model = Job
    extra = 0
    can_delete = False
    readonly_fields = (
        "attempt", "host", "status", "next_seq", "completion_tokens", "earned_ucents", "fail_reason", "claimed_at", "finished_at",
    )
    exclude = ("model", "generated_chars", "last_token_at")


@admin.register(Request)
class RequestAdmin(admin.ModelAdmin):
    list_display = (
        "public_id", "user", "model", "kind", "status", "prompt_tokens", "completion_tokens", "cost_ucents", "resumed",
        "error_code", "created_at",
    )
    list_filter = ("status", "kind", "model", "resumed", "stream", "created_at")
    search_fields = ("public_id", "user__username", "api_key__prefix", "error_code")
    list_select_related = ("user", "model")
    date_hierarchy = "created_at"
    exclude = ("messages", "prompt", "delivered_text")
    readonly_fields = [f.name for f in Request._meta.fields if f.name not in ("messages", "prompt", "delivered_text")]
    inlines = [JobInline]


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = (
        "pk", "request", "attempt", "host", "model", "status", "completion_tokens", "earned_ucents", "fail_reason",
        "claimed_at", "finished_at",
    )
    list_filter = ("status", "model", "attempt", "finished_at")
    search_fields = ("request__public_id", "host__name", "fail_reason")
    list_select_related = ("request", "host", "model")
    readonly_fields = [f.name for f in Job._meta.fields]


@admin.register(TextChunk)
class TextChunkAdmin(admin.ModelAdmin):
    """Where a request's delivered text stands, batch by batch; never the text itself."""

    list_display = ("request", "job", "seq", "char_offset", "length")
    list_select_related = ("request", "job")
    exclude = ("text",)
    readonly_fields = ("request", "job", "seq", "char_offset")

    @admin.display(description="characters")
    def length(self, chunk: TextChunk) -> int:
        return len(chunk.text)


@admin.register(StageShare)
class StageShareAdmin(admin.ModelAdmin):
    """What ring stage hosts earned for the layers they ran (written at settlement, never edited)."""

    list_display = ("finished_at", "job", "host", "plan", "layers", "n_layers", "earned_ucents")
    list_filter = ("plan",)
    search_fields = ("host__name",)
    readonly_fields = list_display

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: StageShare | None = None) -> bool:
        return False


@admin.register(CanaryCheck)
class CanaryCheckAdmin(admin.ModelAdmin):
    """Every hidden test, its verdict and why; the changelist's header says what canaries cost."""

    list_display = ("created_at", "host", "verdict", "reason", "cost")
    list_filter = ("verdict",)
    search_fields = ("host__name", "reason")
    readonly_fields = ("host", "reference", "request", "verdict", "reason", "created_at", "decided_at")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    @admin.display(description="cost")
    def cost(self, check: CanaryCheck) -> str:
        return usd(check.request.cost_ucents)

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        summary = canary_summary()
        rate = "–" if summary["pass_rate"] is None else f"{summary['pass_rate']:.1%}"
        self.message_user(request, f"Canaries: {summary['passed']} passed, {summary['failed']} failed, {summary['void']} void, "
                                   f"{summary['pending']} pending (pass rate {rate}); spent {usd(summary['spent_ucents'])}; "
                                   f"failed verification: {', '.join(summary['failed_hosts']) or 'nobody'}.", messages.INFO)
        return super().changelist_view(request, extra_context)


@admin.register(CanaryReference)
class CanaryReferenceAdmin(admin.ModelAdmin):
    list_display = ("pk", "model", "kind", "max_tokens", "exact_chars", "created_at")
    list_filter = ("model", "kind")
