"""Hosts in the admin. Operators change a host's state through services only:
"Put in maintenance" asks for the reason its owner will read (an intermediate
page, like the delete confirmation), "Resume from maintenance" takes it back.
The token is never shown, not even its hash."""
from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse

from hosts import services
from hosts.models import Host, Qualification


class QualificationInline(admin.TabularInline):
    model = Qualification
    extra = 0
    readonly_fields = ("model", "fingerprint", "prompt_tps", "gen_tps", "ttft_ms", "memory_mb", "threads", "updated_at")
    exclude = ("machine",)


class ConnectionFilter(admin.SimpleListFilter):
    title = "connection"
    parameter_name = "connection"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [("online", "Heartbeat recent"), ("offline", "Offline")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Host]) -> QuerySet[Host]:
        connected = Host.objects.connected()
        if self.value() == "online":
            return queryset.filter(pk__in=connected)
        if self.value() == "offline":
            return queryset.exclude(pk__in=connected)
        return queryset


class MaintenanceFilter(admin.SimpleListFilter):
    title = "maintenance"
    parameter_name = "maintenance"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [("yes", "In maintenance"), ("no", "Not in maintenance")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Host]) -> QuerySet[Host]:
        if self.value() in ("yes", "no"):
            return queryset.filter(maintenance_since__isnull=self.value() == "no")
        return queryset


class MaintenanceForm(forms.Form):
    reason = forms.CharField(
        max_length=300, widget=forms.Textarea(attrs={"rows": 3, "cols": 60}),
        help_text="Shown to each host's owner on their machines page and in the host API.",
    )


class HostAdmin(admin.ModelAdmin):
    """Everything about a host but its work; `marketplace.admin` registers it with the
    status column (busy comes from its jobs)."""

    list_display = (
        "name", "owner", "status", "maintenance_reason", "last_heartbeat_at", "loaded", "paused", "version", "created_at",
    )
    list_filter = (ConnectionFilter, MaintenanceFilter, "paused")
    search_fields = ("name", "owner__username", "token_prefix", "maintenance_reason")
    list_select_related = ("owner",)
    exclude = ("token_hash",)
    readonly_fields = (
        "token_prefix", "fingerprint", "last_heartbeat_at", "models_loaded", "version",
        "maintenance_reason", "maintenance_since", "maintenance_by",
    )
    inlines = [QualificationInline]
    actions = ["maintenance_enter", "maintenance_resume"]

    @admin.display(description="models loaded")
    def loaded(self, host: Host) -> str:
        return ", ".join(host.models_loaded or []) or "—"

    @admin.action(description="Put in maintenance…", permissions=["change"])
    def maintenance_enter(self, request: HttpRequest, queryset: QuerySet[Host]) -> TemplateResponse | None:
        """First call: the reason form. Its POST comes back here with `apply` and does the work."""
        form = MaintenanceForm(request.POST if "apply" in request.POST else None)
        if form.is_bound and form.is_valid():
            entered = [host for host in queryset if services.host_maintenance_enter(
                host=host, reason=form.cleaned_data["reason"], by="operator")]
            skipped = queryset.count() - len(entered)
            self.message_user(request, f"{len(entered)} host(s) put in maintenance.", messages.SUCCESS)
            if skipped:
                self.message_user(request, f"{skipped} already in maintenance; their reason is unchanged.", messages.WARNING)
            return None
        context = {
            **self.admin_site.each_context(request),
            "title": "Put hosts in maintenance",
            "opts": self.model._meta,
            "hosts": queryset,
            "form": form,
            "action_checkbox_name": ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(request, "admin/hosts/host/maintenance.html", context)

    @admin.action(description="Resume from maintenance", permissions=["change"])
    def maintenance_resume(self, request: HttpRequest, queryset: QuerySet[Host]) -> None:
        resumed = sum(services.host_maintenance_resume(host=host) for host in queryset)
        self.message_user(request, f"{resumed} host(s) resumed from maintenance.", messages.SUCCESS)


@admin.register(Qualification)
class QualificationAdmin(admin.ModelAdmin):
    list_display = ("host", "model", "fingerprint", "gen_tps", "prompt_tps", "ttft_ms", "memory_mb", "threads", "updated_at")
    list_filter = ("model",)
    search_fields = ("host__name", "fingerprint")
    list_select_related = ("host", "model")
    readonly_fields = (
        "host", "model", "fingerprint", "prompt_tps", "gen_tps", "ttft_ms", "memory_mb", "threads", "machine",
        "created_at", "updated_at",
    )
