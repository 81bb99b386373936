"""The marketplace in the admin. Keys are revoked through the revoke service
(an action); a key's hash is never shown. Prompts and delivered text stay out."""
from __future__ import annotations

from django.contrib import admin, messages

from billing.services import format_usd
from marketplace import routing, services
from marketplace.models import ApiKey, CatalogModel, Job, Request


@admin.register(CatalogModel)
class CatalogModelAdmin(admin.ModelAdmin):
    list_display = (
        "name", "kind", "context_length", "input_price_ucents", "output_price_ucents", "routing_strategy",
        "latency_critical", "warm_hosts", "active",
    )
    list_filter = ("kind", "active", "latency_critical", "routing_strategy")
    search_fields = ("name",)

    def changelist_view(self, request, extra_context=None):  # type: ignore[no-untyped-def]
        self._counts = routing.warm_host_counts()
        for model, warm in routing.under_redundant_models(counts=self._counts):
            self.message_user(
                request, f"Latency-critical model {model.name} has {warm} warm host(s); keep at least "
                f"{routing.REDUNDANT_WARM_HOSTS} so a failover lands on a warm host.", level=messages.WARNING,
            )
        return super().changelist_view(request, extra_context)

    @admin.display(description="warm / online hosts")
    def warm_hosts(self, obj: CatalogModel) -> str:
        entry = getattr(self, "_counts", {}).get(obj.pk, {"warm": 0, "online": 0})
        flag = " ⚠" if obj.latency_critical and entry["warm"] < routing.REDUNDANT_WARM_HOSTS else ""
        return f"{entry['warm']} / {entry['online']}{flag}"


class RevokedFilter(admin.SimpleListFilter):
    title = "revoked"
    parameter_name = "revoked"

    def lookups(self, request, model_admin):  # type: ignore[no-untyped-def]
        return [("no", "Live"), ("yes", "Revoked")]

    def queryset(self, request, queryset):  # type: ignore[no-untyped-def]
        if self.value() in ("yes", "no"):
            return queryset.filter(revoked_at__isnull=self.value() == "no")
        return queryset


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = (
        "prefix", "name", "user", "cap", "spent", "held", "rate_limit_per_minute", "max_concurrent",
        "revoked", "last_used_at", "created_at",
    )
    list_filter = (RevokedFilter, "created_at", "last_used_at")
    search_fields = ("prefix", "name", "user__username")
    list_select_related = ("user",)
    exclude = ("key_hash",)
    readonly_fields = ("prefix", "user", "spent_ucents", "held_ucents", "revoked_at", "last_used_at", "created_at")
    actions = ["revoke"]

    def has_add_permission(self, request) -> bool:  # type: ignore[no-untyped-def]
        return False  # a key's secret is shown once, to its owner: keys are made on the keys page or by create_customer

    @admin.display(description="cap", ordering="spend_cap_ucents")
    def cap(self, key: ApiKey) -> str:
        return "—" if key.spend_cap_ucents is None else format_usd(key.spend_cap_ucents)

    @admin.display(description="spent", ordering="spent_ucents")
    def spent(self, key: ApiKey) -> str:
        return format_usd(key.spent_ucents)

    @admin.display(description="held", ordering="held_ucents")
    def held(self, key: ApiKey) -> str:
        return format_usd(key.held_ucents)

    @admin.display(description="revoked", boolean=True, ordering="revoked_at")
    def revoked(self, key: ApiKey) -> bool:
        return key.revoked_at is not None

    @admin.action(description="Revoke selected keys", permissions=["change"])
    def revoke(self, request, queryset) -> None:  # type: ignore[no-untyped-def]
        keys = list(queryset)
        revoked = sum(services.api_key_revoke(key=key) for key in keys)
        self.message_user(request, f"{revoked} key(s) revoked; requests with them now get 401.", messages.SUCCESS)
        if revoked < len(keys):
            self.message_user(request, f"{len(keys) - revoked} were already revoked.", messages.INFO)


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
