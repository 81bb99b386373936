"""Hosts in the admin. Operators change a host's state through services only:
"Put in maintenance" and "Ban" ask for the reason its owner will read (an
intermediate page, like the delete confirmation); "Resume from maintenance" and
"Lift the ban" take them back. Bans and unbans are written to the admin's history
with who did it. The token is never shown, not even its hash."""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse

from hosts import services
from hosts.models import Host, HostAllowance, Qualification


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


class TrustFilter(admin.SimpleListFilter):
    title = "trust"
    parameter_name = "trust"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [("probation", "In probation"), ("trusted", "Trusted"), ("banned", "Banned")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Host]) -> QuerySet[Host]:
        if self.value() == "probation":
            return queryset.filter(pk__in=Host.objects.in_probation())
        if self.value() == "trusted":
            return queryset.filter(pk__in=Host.objects.trusted())
        if self.value() == "banned":
            return queryset.filter(banned_at__isnull=False)
        return queryset


class MaintenanceForm(forms.Form):
    reason = forms.CharField(
        max_length=300,
        widget=forms.Textarea(attrs={"rows": 3, "cols": 60}),
        help_text="Shown to each host's owner on their machines page and in the host API.",
    )


class BanForm(forms.Form):
    reason = forms.CharField(
        max_length=300,
        widget=forms.Textarea(attrs={"rows": 3, "cols": 60}),
        help_text="Shown to each host's owner on their machines page and in the host API's refusal.",
    )


class HostAdmin(admin.ModelAdmin):
    """Everything about a host but its work; `marketplace.admin` registers it with the
    status column (busy comes from its jobs)."""

    list_display = (
        "name",
        "owner",
        "status",
        "trust",
        "maintenance_reason",
        "last_heartbeat_at",
        "loaded",
        "paused",
        "version",
        "created_at",
    )
    list_filter = (ConnectionFilter, MaintenanceFilter, TrustFilter, "paused")
    search_fields = ("name", "owner__username", "token_prefix", "maintenance_reason", "ban_reason")
    list_select_related = ("owner",)
    exclude = ("token_hash",)
    readonly_fields = (
        "token_prefix",
        "fingerprint",
        "last_heartbeat_at",
        "models_loaded",
        "version",
        "maintenance_reason",
        "maintenance_since",
        "maintenance_by",
        "trusted_at",
        "measured_tps",
        "banned_at",
        "ban_reason",
        "banned_by",
    )
    inlines = [QualificationInline]
    actions = ["maintenance_enter", "maintenance_resume", "ban", "unban"]

    @admin.display(description="models loaded")
    def loaded(self, host: Host) -> str:
        return ", ".join(host.models_loaded or []) or "—"

    @admin.display(description="trust")
    def trust(self, host: Host) -> str:
        """`Host.standing`, with the reason of a ban."""
        return f"banned: {host.ban_reason}" if host.standing == "banned" else host.standing

    def _reason_page(
        self, request: HttpRequest, queryset: QuerySet[Host], *, template: str, title: str, form: forms.Form
    ) -> TemplateResponse:
        context = {
            **self.admin_site.each_context(request),
            "title": title,
            "opts": self.model._meta,
            "hosts": queryset,
            "form": form,
            "action_checkbox_name": ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(request, f"admin/hosts/host/{template}.html", context)

    @admin.action(description="Put in maintenance…", permissions=["change"])
    def maintenance_enter(self, request: HttpRequest, queryset: QuerySet[Host]) -> TemplateResponse | None:
        """First call: the reason form. Its POST comes back here with `apply` and does the work."""
        form = MaintenanceForm(request.POST if "apply" in request.POST else None)
        if form.is_bound and form.is_valid():
            entered = [
                host
                for host in queryset
                if services.host_maintenance_enter(host=host, reason=form.cleaned_data["reason"], by="operator")
            ]
            skipped = queryset.count() - len(entered)
            self.message_user(request, f"{len(entered)} host(s) put in maintenance.", messages.SUCCESS)
            if skipped:
                self.message_user(
                    request, f"{skipped} already in maintenance; their reason is unchanged.", messages.WARNING
                )
            return None
        return self._reason_page(request, queryset, template="maintenance", title="Put hosts in maintenance", form=form)

    @admin.action(description="Resume from maintenance", permissions=["change"])
    def maintenance_resume(self, request: HttpRequest, queryset: QuerySet[Host]) -> None:
        resumed = sum(services.host_maintenance_resume(host=host) for host in queryset)
        self.message_user(request, f"{resumed} host(s) resumed from maintenance.", messages.SUCCESS)

    def host_ban(self, *, host: Host, reason: str, by: str) -> bool:
        """The ban itself (the marketplace's admin adds what follows from it: jobs, earnings)."""
        return services.host_ban(host=host, reason=reason, by=by)

    @admin.action(description="Ban…", permissions=["change"])
    def ban(self, request: HttpRequest, queryset: QuerySet[Host]) -> TemplateResponse | None:
        """First call: the reason form. Its POST comes back here with `apply`: each host is
        banned (token revoked, sockets closed) under the operator's username."""
        form = BanForm(request.POST if "apply" in request.POST else None)
        if not (form.is_bound and form.is_valid()):
            return self._reason_page(request, queryset, template="ban", title="Ban hosts", form=form)
        reason, by = form.cleaned_data["reason"], request.user.get_username()
        banned = [host for host in queryset if self.host_ban(host=host, reason=reason, by=by)]
        for host in banned:
            self.log_change(request, host, f"Banned: {reason}")
        self.message_user(request, f"{len(banned)} host(s) banned; their tokens no longer work.", messages.SUCCESS)
        if len(banned) < queryset.count():
            self.message_user(
                request, f"{queryset.count() - len(banned)} already banned; their ban is unchanged.", messages.WARNING
            )
        return None

    @admin.action(description="Lift the ban", permissions=["change"])
    def unban(self, request: HttpRequest, queryset: QuerySet[Host]) -> None:
        lifted = [host for host in queryset if services.host_unban(host=host, by=request.user.get_username())]
        for host in lifted:
            self.log_change(request, host, "Ban lifted")
        self.message_user(
            request,
            f"{len(lifted)} ban(s) lifted; each owner must rotate the host's token on their "
            "machines page before it can connect again.",
            messages.SUCCESS,
        )


@admin.register(Qualification)
class QualificationAdmin(admin.ModelAdmin):
    list_display = (
        "host",
        "model",
        "fingerprint",
        "gen_tps",
        "prompt_tps",
        "ttft_ms",
        "memory_mb",
        "threads",
        "updated_at",
    )
    list_filter = ("model",)
    search_fields = ("host__name", "fingerprint")
    list_select_related = ("host", "model")
    readonly_fields = (
        "host",
        "model",
        "fingerprint",
        "prompt_tps",
        "gen_tps",
        "ttft_ms",
        "memory_mb",
        "threads",
        "machine",
        "created_at",
        "updated_at",
    )


@admin.register(HostAllowance)
class HostAllowanceAdmin(admin.ModelAdmin):
    """An owner who runs more machines than HOSTS_PER_ACCOUNT: the operator raises their limit here."""

    list_display = ("owner", "machines", "reason", "updated_at")
    search_fields = ("owner__username", "owner__email")
    raw_id_fields = ("owner",)
