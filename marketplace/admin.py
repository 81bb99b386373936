"""The marketplace in the admin: the catalog with its warm hosts, requests and jobs.
Prompts and delivered text stay out. A catalog model is added from its own GGUF file, as
`manage.py catalog_add` adds one."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse

from catalog.models import CatalogModel
from catalog.money import usd
from catalog.money_admin import MoneyAdmin
from catalog.services import CatalogAddRefused, catalog_model_add
from hosts import selectors as hosts
from hosts.admin import HostAdmin
from hosts.models import Host
from marketplace import selectors, services
from marketplace.lifecycle.canaries import canary_summary
from marketplace.models import (
    Audit,
    AuditScore,
    CanaryCheck,
    CanaryReference,
    Job,
    PrefixBlock,
    Request,
    RingEvidence,
    RingInquiry,
    StageShare,
    StoredResponse,
    TextChunk,
)


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


class CatalogAddForm(forms.Form):
    """`catalog_add`'s arguments. Prices stay text: the service reads them exactly and says what is wrong."""

    path = forms.CharField(
        label="GGUF file",
        max_length=4096,
        help_text=(
            "a path on the gateway's disk, e.g. /srv/models/Llama-3.1-8B-Instruct-Q4_K_M.gguf: models are gigabytes, "
            "never uploaded through the browser"
        ),
    )
    name = forms.CharField(max_length=100, help_text="the model's name in the API")
    input_price = forms.CharField(
        label="Input price", max_length=40, help_text="USD per million prompt tokens, e.g. 0.10"
    )
    output_price = forms.CharField(
        label="Output price", max_length=40, help_text="USD per million generated tokens, e.g. 0.40"
    )
    template = forms.CharField(
        label="Chat template",
        required=False,
        widget=forms.Textarea(attrs={"rows": 6}),
        help_text="Jinja, for a file without tokenizer.chat_template (default: the file's own)",
    )
    template_path = forms.CharField(
        label="Chat template file",
        required=False,
        max_length=4096,
        help_text="or the template as a path on the gateway's disk",
    )
    context_length = forms.IntegerField(
        required=False, help_text="the context sold, in tokens (default: the file's own)"
    )

    def clean(self) -> dict[str, Any]:
        data = self.cleaned_data
        if data.get("template") and data.get("template_path"):
            raise forms.ValidationError("Give the chat template as text or as a file, not both.")
        return data


def catalog_add_from_form(data: dict[str, Any]) -> CatalogModel:
    """`catalog_model_add` with a CatalogAddForm's fields; a template typed in the form reaches it
    as a file, the way catalog_add's --template does."""
    with tempfile.TemporaryDirectory() as folder:
        template_path = Path(data["template_path"]) if data["template_path"] else None
        if data["template"]:
            template_path = Path(folder) / "chat_template.jinja"
            template_path.write_text(data["template"], encoding="utf-8")
        return catalog_model_add(
            path=Path(data["path"]),
            name=data["name"],
            input_price=data["input_price"],
            output_price=data["output_price"],
            template_path=template_path,
            context_length=data["context_length"],
        )


@admin.register(CatalogModel)
class CatalogModelAdmin(MoneyAdmin, admin.ModelAdmin):
    list_display = (
        "name",
        "kind",
        "context_length",
        "input_price_ucents",
        "cached_input_price_ucents",
        "output_price_ucents",
        "routing_strategy",
        "latency_critical",
        "warm_hosts",
        "active",
    )
    list_filter = ("kind", "active", "latency_critical", "routing_strategy")
    search_fields = ("name",)

    def add_view(
        self, request: HttpRequest, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """ "Add" is catalog_add: a model enters the catalog from its own GGUF file (its facts read
        from the file, never typed in). A refusal is the form's error, with nothing written."""
        if not self.has_add_permission(request):
            raise PermissionDenied
        form = CatalogAddForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            try:
                entry = catalog_add_from_form(form.cleaned_data)
            except CatalogAddRefused as refused:
                form.add_error(None, " ".join(refused.message.split()))
            else:
                self.log_addition(request, entry, [{"added": {}}])
                return self.response_add(request, entry)
        # (AdminForm and AdminErrorList take any form, a plain one here; django-stubs say ModelForm)
        adminform = helpers.AdminForm(
            form,  # type: ignore[arg-type]
            [(None, {"fields": list(form.fields)})],
            {},
            model_admin=self,
        )
        context = {
            **self.admin_site.each_context(request),
            "title": "Add a catalog model from its GGUF file",
            "subtitle": None,
            "adminform": adminform,
            "object_id": None,
            "original": None,
            "is_popup": False,
            "to_field": None,
            "media": self.media + adminform.media,
            "inline_admin_formsets": [],
            "errors": helpers.AdminErrorList(form, []),  # type: ignore[arg-type]
            "preserved_filters": self.get_preserved_filters(request),
            **(extra_context or {}),
        }
        return self.render_change_form(request, context, add=True, form_url=form_url)

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        self._counts = hosts.warm_host_counts()
        for model, warm in hosts.under_redundant_models(counts=self._counts):
            self.message_user(
                request,
                f"Latency-critical model {model.name} has {warm} warm host(s); keep at least "
                f"{hosts.REDUNDANT_WARM_HOSTS} so a failover lands on a warm host.",
                level=messages.WARNING,
            )
        return super().changelist_view(request, extra_context)

    @admin.display(description="warm / online hosts")
    def warm_hosts(self, obj: CatalogModel) -> str:
        entry = getattr(self, "_counts", {}).get(obj.pk, {"warm": 0, "online": 0})
        flag = " ⚠" if obj.latency_critical and entry["warm"] < hosts.REDUNDANT_WARM_HOSTS else ""
        return f"{entry['warm']} / {entry['online']}{flag}"


class JobInline(MoneyAdmin, admin.TabularInline):
    model = Job
    extra = 0
    can_delete = False
    readonly_fields = (
        "attempt",
        "host",
        "status",
        "next_seq",
        "completion_tokens",
        "earned_ucents",
        "fail_reason",
        "claimed_at",
        "finished_at",
    )
    exclude = ("model", "generated_chars", "last_token_at")


@admin.register(Request)
class RequestAdmin(MoneyAdmin, admin.ModelAdmin):
    list_display = (
        "public_id",
        "user",
        "model",
        "kind",
        "status",
        "prompt_tokens",
        "completion_tokens",
        "cost_ucents",
        "resumed",
        "error_code",
        "created_at",
    )
    list_filter = ("status", "kind", "model", "resumed", "stream", "created_at")
    search_fields = ("public_id", "user__username", "api_key__prefix", "error_code")
    list_select_related = ("user", "model")
    date_hierarchy = "created_at"
    exclude = ("messages", "prompt", "delivered_text", "prefix_hashes")
    readonly_fields = [
        f.name for f in Request._meta.fields if f.name not in ("messages", "prompt", "delivered_text", "prefix_hashes")
    ]
    inlines = [JobInline]


@admin.register(Job)
class JobAdmin(MoneyAdmin, admin.ModelAdmin):
    list_display = (
        "pk",
        "request",
        "attempt",
        "host",
        "model",
        "status",
        "completion_tokens",
        "earned_ucents",
        "fail_reason",
        "claimed_at",
        "finished_at",
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


@admin.register(PrefixBlock)
class PrefixBlockAdmin(admin.ModelAdmin):
    """Which prompt prefixes the gateway routed to which host for which account (issue 53), and
    until when; the hashes only, never a prompt. Rows are written by claims and expire by
    themselves (PROMPT_CACHE_SECONDS); an operator may delete one early."""

    list_display = ("user", "model", "host", "tokens", "expires_at")
    list_select_related = ("user", "model", "host")
    readonly_fields = ("user", "model", "host", "block_hash", "tokens", "expires_at")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False


@admin.register(StoredResponse)
class StoredResponseAdmin(admin.ModelAdmin):
    """Which Responses API answers are kept (`store: true`) and until when; never the conversation
    or the answer itself. An operator may delete one early (a customer's request to forget it)."""

    list_display = ("request", "expires_at")
    list_select_related = ("request",)
    search_fields = ("request__public_id",)
    exclude = ("conversation", "body")
    readonly_fields = ("request", "expires_at")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False


@admin.register(StageShare)
class StageShareAdmin(MoneyAdmin, admin.ModelAdmin):
    """What ring stage hosts earned for the layers they ran (written at settlement, never edited)."""

    list_display = ("finished_at", "job", "host", "plan", "layers", "n_layers", "earned_ucents")
    list_filter = ("plan",)
    search_fields = ("host__name",)
    readonly_fields = list_display

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: StageShare | None = None) -> bool:
        return False


class _ReadOnly:
    """Rows the workers and the hosts write: nobody adds, edits or deletes them here."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


@admin.register(Audit)
class AuditAdmin(_ReadOnly, MoneyAdmin, admin.ModelAdmin):
    """Every audit of a real job, its verdict, counts and evidence (never the answer's text:
    it is deleted when the audit is decided). Read-only: audits are decided by the workers."""

    list_display = (
        "created_at",
        "host",
        "request",
        "status",
        "by_hosts",
        "checked",
        "uncertain",
        "misses",
        "host_ucents",
        "reason",
    )
    list_filter = ("status", "by_hosts")
    search_fields = ("host__name", "request__public_id", "reason")
    fields = readonly_fields = (
        "job",
        "host",
        "request",
        "status",
        "by_hosts",
        "scorer",
        "scorer_since",
        "host_ucents",
        "platform_ucents",
        "finish_reason",
        "checked",
        "uncertain",
        "misses",
        "reason",
        "created_at",
        "decided_at",
    )


@admin.register(AuditScore)
class AuditScoreAdmin(_ReadOnly, MoneyAdmin, admin.ModelAdmin):
    """Each trusted host's reading of an audit scored by hosts: verdict, counts, whether a
    confirmation overruled it (a strike) and its fee. Read-only: scorers' verdicts decide them."""

    list_display = ("created_at", "audit", "scorer", "verdict", "overruled", "checked", "misses", "paid_ucents")
    list_filter = ("verdict", "overruled")
    search_fields = ("scorer__name", "reason")
    fields = readonly_fields = (
        "audit",
        "scorer",
        "verdict",
        "reason",
        "checked",
        "uncertain",
        "misses",
        "overruled",
        "paid_ucents",
        "created_at",
    )


@admin.register(RingInquiry)
class RingInquiryAdmin(_ReadOnly, admin.ModelAdmin):
    """Each ring's failed audit looked into: its status, the checkers' verdicts and whom they
    blamed (never the job or the evidence: deleted when decided). Read-only: checkers decide."""

    list_display = ("created_at", "plan", "status", "checker", "blamed", "decided_at")
    list_filter = ("status",)
    search_fields = ("verdict", "audit_reason")
    fields = readonly_fields = (
        "audit",
        "plan",
        "status",
        "audit_reason",
        "checker",
        "checker_since",
        "declined_by",
        "verdicts",
        "blamed",
        "verdict",
        "created_at",
        "checking_since",
        "decided_at",
    )


@admin.register(RingEvidence)
class RingEvidenceAdmin(_ReadOnly, admin.ModelAdmin):
    """The parts of evidence stages handed over for inquiries still open (their contents are
    hidden states of a customer's prompt: not shown)."""

    list_display = ("received_at", "inquiry", "stage", "host", "part", "parts")
    fields = readonly_fields = ("inquiry", "stage", "host", "part", "parts", "received_at")


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
        self.message_user(
            request,
            f"Canaries: {summary['passed']} passed, {summary['failed']} failed, {summary['void']} void, "
            f"{summary['pending']} pending (pass rate {rate}); spent {usd(summary['spent_ucents'])}; "
            f"failed verification: {', '.join(summary['failed_hosts']) or 'nobody'}.",
            messages.INFO,
        )
        return super().changelist_view(request, extra_context)


@admin.register(CanaryReference)
class CanaryReferenceAdmin(admin.ModelAdmin):
    list_display = ("pk", "model", "kind", "max_tokens", "exact_chars", "created_at")
    list_filter = ("model", "kind")
