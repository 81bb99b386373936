from __future__ import annotations

from django.contrib import admin

from hosts.models import Host, Qualification


class QualificationInline(admin.TabularInline):
    model = Qualification
    extra = 0
    readonly_fields = ("model", "fingerprint", "prompt_tps", "gen_tps", "ttft_ms", "memory_mb", "threads", "updated_at")
    exclude = ("machine",)


@admin.register(Host)
class HostAdmin(admin.ModelAdmin):
    list_display = ("name", "owner", "paused", "last_heartbeat_at", "version", "created_at")
    list_filter = ("paused",)
    search_fields = ("name", "owner__username", "token_prefix")
    readonly_fields = ("token_prefix", "token_hash", "fingerprint", "last_heartbeat_at", "models_loaded", "version")
    inlines = [QualificationInline]


@admin.register(Qualification)
class QualificationAdmin(admin.ModelAdmin):
    list_display = ("host", "model", "fingerprint", "gen_tps", "prompt_tps", "ttft_ms", "memory_mb", "updated_at")
    list_filter = ("model",)
