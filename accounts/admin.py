"""API keys in the admin. Keys are revoked through the revoke service (an action);
a key's hash is never shown."""

from __future__ import annotations

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from accounts import services
from accounts.models import ApiKey
from catalog.money import usd
from catalog.money_admin import MoneyAdmin


class RevokedFilter(admin.SimpleListFilter):
    title = "revoked"
    parameter_name = "revoked"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [("no", "Live"), ("yes", "Revoked")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> QuerySet[ApiKey]:
        if self.value() in ("yes", "no"):
            return queryset.filter(revoked_at__isnull=self.value() == "no")
        return queryset


@admin.register(ApiKey)
class ApiKeyAdmin(MoneyAdmin, admin.ModelAdmin):
    list_display = (
        "prefix",
        "name",
        "user",
        "cap",
        "spent",
        "held",
        "rate_limit_per_minute",
        "max_concurrent",
        "revoked",
        "last_used_at",
        "created_at",
    )
    list_filter = (RevokedFilter, "created_at", "last_used_at")
    search_fields = ("prefix", "name", "user__username")
    list_select_related = ("user",)
    exclude = ("key_hash",)
    readonly_fields = ("prefix", "user", "spent_ucents", "held_ucents", "revoked_at", "last_used_at", "created_at")
    actions = ["revoke"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # a key's secret is shown once, to its owner: keys are made on the keys page or by create_customer

    @admin.display(description="cap", ordering="spend_cap_ucents")
    def cap(self, key: ApiKey) -> str:
        return "—" if key.spend_cap_ucents is None else usd(key.spend_cap_ucents)

    @admin.display(description="spent", ordering="spent_ucents")
    def spent(self, key: ApiKey) -> str:
        return usd(key.spent_ucents)

    @admin.display(description="held", ordering="held_ucents")
    def held(self, key: ApiKey) -> str:
        return usd(key.held_ucents)

    @admin.display(description="revoked", boolean=True, ordering="revoked_at")
    def revoked(self, key: ApiKey) -> bool:
        return key.revoked_at is not None

    @admin.action(description="Revoke selected keys", permissions=["change"])
    def revoke(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> None:
        keys = list(queryset)
        revoked = sum(services.api_key_revoke(key=key) for key in keys)
        self.message_user(request, f"{revoked} key(s) revoked; requests with them now get 401.", messages.SUCCESS)
        if revoked < len(keys):
            self.message_user(request, f"{len(keys) - revoked} were already revoked.", messages.INFO)
