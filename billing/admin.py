"""The ledger in the admin is read-only: corrections are new transactions.

Operators act through services only: "Grant credit" posts a GRANT with a
reason (a balance is never edited); payouts are approved (Stripe Transfer) or
rejected (reverse entry) with actions.
"""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.db.models import Model, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html

from billing import services
from billing.errors import BillingError
from billing.models import Account, Hold, LedgerEntry, LedgerTransaction, Payout, PayoutProfile, StripeEvent, TopUp
from catalog.money import usd, usd_to_ucents
from catalog.money_admin import MoneyAdmin
from core.http import AuthedHttpRequest


class ReadOnlyAdmin(MoneyAdmin, admin.ModelAdmin):
    def has_add_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False


class GrantForm(forms.Form):
    amount_usd = forms.DecimalField(max_digits=12, decimal_places=8, min_value=0, label="Amount (USD)")
    reason = forms.CharField(max_length=200, help_text="kept in the ledger transaction's memo")


@admin.register(Account)
class AccountAdmin(ReadOnlyAdmin):
    list_display = ("pk", "kind", "user", "host", "balance_ucents", "held_ucents", "grant_link")
    list_filter = ("kind",)
    search_fields = ("user__username", "host__name")
    list_select_related = ("user", "host")

    @admin.display(description="")
    def grant_link(self, account: Account) -> str:
        if account.kind != Account.Kind.CUSTOMER:
            return ""
        return format_html('<a href="{}">Grant credit…</a>', reverse("admin:billing_account_grant", args=[account.pk]))

    def get_urls(self) -> list[URLPattern]:
        grant = path(
            "<int:account_id>/grant/", self.admin_site.admin_view(self.grant_view), name="billing_account_grant"
        )
        return [grant, *super().get_urls()]

    def grant_view(self, request: AuthedHttpRequest, account_id: int) -> HttpResponse:
        """A form that posts a ledger GRANT (funding → this customer) with a reason."""
        account = get_object_or_404(Account, pk=account_id, kind=Account.Kind.CUSTOMER)
        if not request.user.has_perm("billing.add_ledgertransaction") and not request.user.is_superuser:
            messages.error(request, "You may not grant credit.")
            return HttpResponseRedirect(reverse("admin:billing_account_changelist"))
        form = GrantForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            assert account.user is not None  # a customer account is made for its user (`ledger.account_for_customer`)
            try:
                amount = usd_to_ucents(form.cleaned_data["amount_usd"])
                services.credit_grant_by_operator(
                    user=account.user, amount_ucents=amount, reason=form.cleaned_data["reason"], operator=request.user
                )
            except (ValueError, BillingError) as error:
                form.add_error(None, str(error))
            else:
                messages.success(request, f"Granted {usd(amount)} to {account.user}.")
                return HttpResponseRedirect(reverse("admin:billing_account_changelist"))
        context = {
            **self.admin_site.each_context(request),
            "title": f"Grant credit to {account.user}",
            "form": form,
            "account": account,
        }
        return TemplateResponse(request, "admin/billing/grant.html", context)


class EntryInline(MoneyAdmin, admin.TabularInline):
    model = LedgerEntry
    extra = 0
    can_delete = False
    readonly_fields = ("account", "amount_ucents")


@admin.register(LedgerTransaction)
class LedgerTransactionAdmin(ReadOnlyAdmin):
    list_display = ("pk", "kind", "reference", "memo", "created_at")
    list_filter = ("kind", "created_at")
    search_fields = ("reference", "memo")
    date_hierarchy = "created_at"
    inlines = [EntryInline]


@admin.register(LedgerEntry)
class LedgerEntryAdmin(ReadOnlyAdmin):
    list_display = ("pk", "transaction", "account", "amount_ucents")
    list_filter = ("account__kind", "transaction__kind")
    search_fields = ("transaction__reference", "account__user__username", "account__host__name")
    list_select_related = ("transaction", "account")


@admin.register(Hold)
class HoldAdmin(ReadOnlyAdmin):
    list_display = ("pk", "account", "api_key", "amount_ucents", "status", "created_at", "closed_at")
    list_filter = ("status", "created_at")
    search_fields = ("api_key__prefix", "account__user__username")
    list_select_related = ("account", "api_key")


@admin.register(TopUp)
class TopUpAdmin(ReadOnlyAdmin):
    list_display = ("pk", "user", "amount_cents", "currency", "status", "stripe_session_id", "created_at", "paid_at")
    list_filter = ("status", "currency", "created_at")
    search_fields = ("stripe_session_id", "user__username")


@admin.register(StripeEvent)
class StripeEventAdmin(ReadOnlyAdmin):
    list_display = ("event_id", "type", "outcome", "topup", "detail", "received_at")
    list_filter = ("outcome", "type")
    search_fields = ("event_id",)


@admin.register(PayoutProfile)
class PayoutProfileAdmin(admin.ModelAdmin):
    list_display = ("host", "stripe_account_id", "updated_at")
    list_select_related = ("host",)
    search_fields = ("host__name", "stripe_account_id")


@admin.register(Payout)
class PayoutAdmin(ReadOnlyAdmin):
    list_display = (
        "pk",
        "host",
        "amount_ucents",
        "status",
        "destination",
        "stripe_transfer_id",
        "failure_reason",
        "created_at",
        "decided_at",
    )
    list_filter = ("status", "created_at")
    search_fields = ("host__name", "host__owner__username", "stripe_transfer_id")
    list_select_related = ("host",)
    actions = ["approve", "reject"]

    def has_change_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return request.user.has_perm("billing.change_payout")  # needed for the actions; no field is editable

    def get_readonly_fields(self, request: HttpRequest, obj: Model | None = None) -> list[str]:
        return [field.name for field in Payout._meta.fields]

    @admin.action(description="Approve: send the Stripe transfer")
    def approve(self, request: AuthedHttpRequest, queryset: QuerySet[Payout]) -> None:
        for payout_id in queryset.values_list("pk", flat=True):
            try:
                payout = services.payout_approve(payout_id=payout_id, operator=request.user)
            except BillingError as error:
                self.message_user(request, error.message, messages.ERROR)
                continue
            level = messages.SUCCESS if payout.status == Payout.Status.PAID else messages.WARNING
            self.message_user(request, f"{payout}: {payout.failure_reason or payout.stripe_transfer_id}", level)

    @admin.action(description="Reject: return the earnings to the host")
    def reject(self, request: HttpRequest, queryset: QuerySet[Payout]) -> None:
        for payout in queryset.filter(status=Payout.Status.REQUESTED):
            if services.payout_void(payout_id=payout.pk, reason=f"rejected by {request.user}"):
                self.message_user(request, f"{payout} rejected; earnings returned.", messages.SUCCESS)
