from __future__ import annotations

from django.contrib import admin

from marketplace.models import ApiKey, CatalogModel, Job, Request


@admin.register(CatalogModel)
class CatalogModelAdmin(admin.ModelAdmin):
    list_display = ("name", "kind", "context_length", "input_price_ucents", "output_price_ucents", "active")
    list_filter = ("kind", "active")


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = (
        "prefix", "name", "user", "spend_cap_ucents", "spent_ucents", "held_ucents", "rate_limit_per_minute", "max_concurrent",
        "revoked_at", "created_at",
    )
    list_filter = ("revoked_at",)
    search_fields = ("prefix", "name", "user__username")
    readonly_fields = ("prefix", "key_hash", "spent_ucents", "held_ucents")


class JobInline(admin.TabularInline):
    model = Job
    extra = 0
    can_delete = False
    readonly_fields = ("attempt", "host", "status", "next_seq", "completion_tokens", "earned_ucents", "fail_reason", "claimed_at", "finished_at")
    exclude = ("model", "generated_chars", "last_token_at")


@admin.register(Request)
class RequestAdmin(admin.ModelAdmin):
    list_display = ("public_id", "user", "model", "kind", "status", "prompt_tokens", "completion_tokens", "cost_ucents", "resumed", "created_at")
    list_filter = ("status", "kind", "model", "resumed")
    search_fields = ("public_id", "user__username")
    exclude = ("messages", "prompt", "delivered_text")
    readonly_fields = [f.name for f in Request._meta.fields if f.name not in ("messages", "prompt", "delivered_text")]
    inlines = [JobInline]


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = ("pk", "request", "attempt", "host", "model", "status", "completion_tokens", "earned_ucents", "claimed_at", "finished_at")
    list_filter = ("status", "model")
    readonly_fields = [f.name for f in Job._meta.fields]
