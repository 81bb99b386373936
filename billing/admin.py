"""The ledger in the admin is read-only: corrections are new transactions."""
from __future__ import annotations

from django.contrib import admin

from billing.models import Account, Hold, LedgerEntry, LedgerTransaction


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request, obj=None) -> bool:  # type: ignore[no-untyped-def]
        return False

    def has_change_permission(self, request, obj=None) -> bool:  # type: ignore[no-untyped-def]
        return False

    def has_delete_permission(self, request, obj=None) -> bool:  # type: ignore[no-untyped-def]
        return False


@admin.register(Account)
class AccountAdmin(ReadOnlyAdmin):
    list_display = ("pk", "kind", "user", "host", "balance_ucents", "held_ucents")
    list_filter = ("kind",)


class EntryInline(admin.TabularInline):
    model = LedgerEntry
    extra = 0
    can_delete = False
    readonly_fields = ("account", "amount_ucents")


@admin.register(LedgerTransaction)
class LedgerTransactionAdmin(ReadOnlyAdmin):
    list_display = ("pk", "kind", "reference", "memo", "created_at")
    list_filter = ("kind",)
    search_fields = ("reference",)
    inlines = [EntryInline]


@admin.register(LedgerEntry)
class LedgerEntryAdmin(ReadOnlyAdmin):
    list_display = ("pk", "transaction", "account", "amount_ucents")


@admin.register(Hold)
class HoldAdmin(ReadOnlyAdmin):
    list_display = ("pk", "account", "api_key", "amount_ucents", "status", "created_at", "closed_at")
    list_filter = ("status",)
