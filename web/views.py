"""The site's pages. Each view parses input, calls one service or selector, renders.

Every page but sign-up/log-in needs a session; every read is scoped to the
signed-in user (web.selectors), so an outsider's id answers 404.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import date
from functools import wraps
from typing import Any

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import login
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.contrib.auth.forms import PasswordResetForm
from django.core.exceptions import PermissionDenied
from django.db import IntegrityError
from django.http import (
    FileResponse,
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseBase,
    JsonResponse,
    StreamingHttpResponse,
)
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_http_methods, require_POST
from django_ratelimit.decorators import ratelimit

from accounts import services as accounts
from accounts.services import AccountUnconfirmed
from billing import selectors as billing_selectors
from billing import services as billing
from billing import stripe_api
from billing.errors import BillingError
from catalog.models import CatalogModel
from catalog.money import usd
from core.http import AuthedHttpRequest
from hosts import selectors as host_selectors
from hosts import services as hosts
from hosts.models import Host
from marketplace import selectors as marketplace_selectors
from marketplace.openai.usage_apis import usage_csv_response
from marketplace.trust import reputation
from protocol.version import MAHOUT_VERSION as mahout_version
from web import selectors
from web.charts import BarChart, bar_chart
from web.forms import ApiKeyForm, DateRangeForm, HostForm, PayoutForm, SignupForm, TopupForm
from web.services import VERIFY_SALT, email_unverified, email_verify, signup_request, verification_resend


def staff_required(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Anonymous → the login page; signed in but not staff → 403."""

    @wraps(view)
    @login_required
    def wrapped(request: AuthedHttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if not request.user.is_staff:
            raise PermissionDenied("Operators only.")
        return view(request, *args, **kwargs)

    return wrapped


def base_url(request: HttpRequest) -> str:
    """This gateway's address as the visitor reached it, without a trailing slash."""
    return request.build_absolute_uri("/").rstrip("/")


def render_secret_once(request: HttpRequest, template: str, context: dict, *, secret_shown: bool) -> HttpResponse:
    """Render a page that may carry a new secret (a key, a host token); such a response is never cached."""
    response = render(request, template, context)
    if secret_shown:
        response["Cache-Control"] = "no-store"
    return response


# --- accounts ------------------------------------------------------------------------------


@require_http_methods(["GET", "POST"])
@ratelimit(key="ip", rate=lambda group, request: settings.SIGNUP_RATE, method="POST", block=False)
def signup(request: HttpRequest) -> HttpResponse:
    if request.user.is_authenticated:
        return redirect("dashboard")
    form = SignupForm(request.POST or None)
    if getattr(request, "limited", False):  # many sign-ups from one address: told, not served
        form.add_error(None, "Too many sign-ups from your address; try again in an hour.")
        return render(request, "web/signup.html", {"form": form}, status=429)
    if request.method == "POST" and form.is_valid():
        email = form.cleaned_data["email"].strip().lower()
        signup_request(
            email=email,
            password=form.cleaned_data["password"],
            link_for=lambda token: request.build_absolute_uri(reverse("verify_email", args=[token])),
        )
        return render(
            request, "web/signup_sent.html", {"email": email}
        )  # the same page whether or not it had an account
    return render(request, "web/signup.html", {"form": form})


@require_http_methods(["GET", "POST"])
@ratelimit(key="ip", rate="10/h", method="POST", block=False)
def verify_email(request: HttpRequest, token: str) -> HttpResponse:
    """The link from the sign-up e-mail asks for the password that sign-up chose; with it, the
    address is confirmed (once: the link then stops working) and its owner is signed in."""
    email = _token_email(token)
    if email is None:
        return render(request, "web/verify_failed.html", status=400)
    if request.method == "GET":
        return render(request, "web/verify_email.html", {"email": email})
    if getattr(request, "limited", False):
        return render(
            request, "web/verify_email.html", {"email": email, "error": "Too many tries; wait an hour."}, status=429
        )
    user, why = email_verify(token=token, password=request.POST.get("password", ""))
    if user is None:
        wrong_password = why.startswith("That is not the password")
        return render(
            request,
            "web/verify_email.html" if wrong_password else "web/verify_failed.html",
            {"email": email, "error": why, "reason": why},
            status=400,
        )
    login(request, user, backend="django.contrib.auth.backends.ModelBackend")
    messages.success(request, f"{user.email} is confirmed. Welcome to Elephant: create an API key to start.")
    return redirect("keys")


def _token_email(token: str) -> str | None:
    """The address a link's token names (its signature checked, not its age or use), or None."""
    from django.core import signing

    try:
        return str(signing.loads(token, salt=VERIFY_SALT).get("email") or "") or None
    except (signing.BadSignature, AttributeError):
        return None


_password_reset = auth_views.PasswordResetView.as_view(
    template_name="web/password_reset.html",
    email_template_name="web/password_reset_email.txt",
    subject_template_name="web/password_reset_subject.txt",
)


def _reset_email(group: str, request: HttpRequest) -> str:
    """The address a reset is asked for, as the limit counts it (whether or not an account has it)."""
    return request.POST.get("email", "").strip().lower()[:254]


@require_http_methods(["GET", "POST"])
@ratelimit(
    group="password_reset.ip",
    key="ip",
    rate=lambda group, request: settings.PASSWORD_RESET_IP_RATE,
    method="POST",
    block=False,
)
@ratelimit(
    group="password_reset.email",
    key=_reset_email,
    rate=lambda group, request: settings.PASSWORD_RESET_EMAIL_RATE,
    method="POST",
    block=False,
)
def password_reset(request: HttpRequest) -> HttpResponseBase:
    """Django's reset page, its e-mails limited per address asked for (PASSWORD_RESET_EMAIL_RATE:
    nobody's inbox is flooded) and per client address (PASSWORD_RESET_IP_RATE). A limited
    request sends nothing and is told so (429); the limit is the same for an address with no
    account, so it reveals none."""
    if getattr(request, "limited", False):
        form = PasswordResetForm(request.POST)
        form.add_error(
            None,
            "Too many reset links were asked for from your address or for this e-mail; use the latest "
            "one sent, or try again in an hour.",
        )
        return render(request, "web/password_reset.html", {"form": form}, status=429)
    return _password_reset(request)


@login_required
@require_POST
@ratelimit(key="user", rate="3/h", method="POST", block=False)
def verify_resend(request: AuthedHttpRequest) -> HttpResponse:
    """The keys page's "send the link again" for an account not yet confirmed (three an hour)."""
    if getattr(request, "limited", False):
        messages.error(request, "Three links were sent in the last hour; use the latest, or try again later.")
    elif verification_resend(
        user=request.user, link_for=lambda token: request.build_absolute_uri(reverse("verify_email", args=[token]))
    ):
        messages.success(request, f"A new confirmation link is on its way to {request.user.email}.")
    return redirect("keys")


# --- customer ------------------------------------------------------------------------------


@login_required
@require_GET
def dashboard(request: AuthedHttpRequest) -> HttpResponse:
    outcome = request.GET.get("topup")
    if outcome == "success":
        messages.info(request, "Thank you. Your credit appears as soon as Stripe confirms the payment.")
    elif outcome == "cancelled":
        messages.info(request, "The top-up was cancelled; nothing was charged.")
    return render(
        request,
        "web/dashboard.html",
        {
            "balance": selectors.customer_balance(user=request.user),
            "topup_form": TopupForm(),
            "topup_rule": billing.topup_rule(),
            "topups_configured": stripe_api.topups_configured(),
            "keys_live": selectors.api_keys_of(user=request.user).filter(revoked_at__isnull=True).count(),
        },
    )


@login_required
@require_POST
def topup(request: AuthedHttpRequest) -> HttpResponse:
    form = TopupForm(request.POST)
    if not form.is_valid():
        messages.error(request, " ".join(str(error) for error in form.errors["amount_usd"]))
        return redirect("dashboard")
    back = request.build_absolute_uri(
        reverse("dashboard")
    )  # (Stripe returns to the gateway as this visitor reached it)
    try:
        created = billing.topup_create(
            user=request.user,
            amount_cents=form.amount_cents,
            success_url=f"{back}?topup=success",
            cancel_url=f"{back}?topup=cancelled",
        )
    except BillingError as error:
        messages.error(request, error.message)
        return redirect("dashboard")
    return redirect(created.checkout_url)


@login_required
@require_http_methods(["GET", "POST"])
def keys(request: AuthedHttpRequest) -> HttpResponse:
    """List keys; a POST creates one and renders its secret on this response only (never stored)."""
    form = ApiKeyForm(request.POST or None)
    new_key = None
    if request.method == "POST" and form.is_valid():
        try:
            new_key = accounts.api_key_create(
                user=request.user,
                name=form.cleaned_data["name"],
                spend_cap_ucents=form.spend_cap_ucents,
                trusted_only=form.cleaned_data["trusted_only"],
                account_wide=form.cleaned_data["account_wide"],
            )
        except accounts.AccountUnconfirmed:
            messages.error(
                request, "Confirm your e-mail address first (the link we sent): until then no key can be made."
            )
        else:
            form = ApiKeyForm()
    return render_secret_once(
        request,
        "web/keys.html",
        {
            "form": form,
            "new_key": new_key,
            "keys": selectors.api_keys_of(user=request.user),
            "base_url": base_url(request),
            "unverified": email_unverified(request.user),
        },
        secret_shown=new_key is not None,
    )


@login_required
@require_POST
def key_revoke(request: AuthedHttpRequest, key_id: int) -> HttpResponse:
    key = selectors.api_key_of(user=request.user, key_id=key_id)
    if key is None:
        raise Http404("No such key.")
    if accounts.api_key_revoke(key=key):
        messages.success(request, f"Key {key.prefix}… revoked; requests with it are refused from now on.")
    else:
        messages.info(request, f"Key {key.prefix}… was already revoked.")
    return redirect("keys")


def _usage_charts(daily: list[Mapping[str, Any]], start: date, end: date) -> list[BarChart]:
    by_day = {row["day"]: row for row in daily}
    days = selectors.days_between(start, end)

    def series(field: Callable[[Mapping[str, Any] | None], int]) -> list[tuple[str, int]]:
        return [(day.isoformat(), field(by_day.get(day))) for day in days]

    return [
        bar_chart(title="Requests per day", points=series(lambda row: row["requests"] if row else 0)),
        bar_chart(
            title="Tokens per day",
            points=series(lambda row: (row["prompt_tokens"] or 0) + (row["completion_tokens"] or 0) if row else 0),
        ),
        bar_chart(title="Cost per day", points=series(lambda row: row["cost_ucents"] or 0 if row else 0), fmt=usd),
    ]


@login_required
@require_GET
def usage(request: AuthedHttpRequest) -> HttpResponse:
    range_form = DateRangeForm(request.GET)
    start, end = range_form.range()
    daily = marketplace_selectors.usage_daily(user=request.user, start=start, end=end)
    return render(
        request,
        "web/usage.html",
        {
            "range_form": range_form,
            "start": start,
            "end": end,
            "charts": _usage_charts(daily, start, end),
            "total_cost_ucents": sum(row["cost_ucents"] or 0 for row in daily),
            "total_requests": sum(row["requests"] for row in daily),
            "total_tokens": sum((row["prompt_tokens"] or 0) + (row["completion_tokens"] or 0) for row in daily),
            "total_cached_tokens": sum(row["cached_tokens"] or 0 for row in daily),
            "breakdowns": [
                ("By model", selectors.usage_breakdown(user=request.user, start=start, end=end, by="model"), "model"),
                ("By key", selectors.usage_breakdown(user=request.user, start=start, end=end, by="key"), "key"),
            ],
            "topups": selectors.topups_of(user=request.user),
            "recent": selectors.recent_requests(user=request.user),
        },
    )


@login_required
@require_GET
def usage_csv(request: AuthedHttpRequest) -> StreamingHttpResponse:
    """The same CSV as GET /v1/usage.csv, for the signed-in customer."""
    start, end = DateRangeForm(request.GET).range()
    return usage_csv_response(user=request.user, start=start, end=end)


@login_required
@require_GET
def catalog(request: AuthedHttpRequest) -> HttpResponse:
    return render(request, "web/catalog.html", {"models": selectors.catalog_models()})


@login_required
@require_GET
def quickstart(request: AuthedHttpRequest) -> HttpResponse:
    """Snippets to copy and run: chat with a chat model, embeddings with an embeddings model."""
    return render(
        request,
        "web/quickstart.html",
        {
            "base_url": base_url(request),
            "chat_model": selectors.quickstart_model(kind=CatalogModel.Kind.CHAT),
            "embedding_model": selectors.quickstart_model(kind=CatalogModel.Kind.EMBEDDING),
        },
    )


# --- hosts ----------------------------------------------------------------------------------


@login_required
@require_http_methods(["GET", "POST"])
def machines(request: AuthedHttpRequest) -> HttpResponse:
    """The user's machines; a POST registers one and renders its token on this response only."""
    form = HostForm(request.POST or None)
    new_host = None
    if request.method == "POST" and form.is_valid():
        try:
            # username is the e-mail for everyone who signed up here, so the host is this user's
            new_host = hosts.host_create(email=request.user.username, name=form.cleaned_data["name"])
        except IntegrityError:
            form.add_error("name", "You already have a machine with this name.")
        except AccountUnconfirmed:
            messages.error(
                request,
                "Confirm your e-mail address first (the link we sent): until then no machine can be registered.",
            )
        except hosts.MachineLimitReached:
            form.add_error(
                None,
                "Your account has the most machines it may register "
                f"({host_selectors.machines_allowed(request.user)}). "
                "Ask an operator to raise the limit if you run more.",
            )
        else:
            form = HostForm()
    return _machines_page(request, form=form, new_host=new_host)


def _machines_page(
    request: AuthedHttpRequest, *, form: HostForm, new_host: hosts.NewHost | None, rotated: bool = False
) -> HttpResponse:
    return render_secret_once(
        request,
        "web/machines.html",
        {
            "form": form,
            "new_host": new_host,
            "rotated": rotated,
            "hosts": selectors.host_statuses(user=request.user),
            "base_url": base_url(request),
            "under_redundant": host_selectors.under_redundant_models(),
            "unverified": email_unverified(request.user),
            "wheel_name": MAHOUT_WHEEL,
            "wheel_built": (settings.BASE_DIR / "dist" / MAHOUT_WHEEL).is_file(),
        },
        secret_shown=new_host is not None,
    )


MAHOUT_WHEEL = f"elephant_mahout-{mahout_version}-py3-none-any.whl"


@require_GET
def mahout_download(request: HttpRequest, filename: str) -> HttpResponseBase:
    """The host client's wheel (`make mahout-wheel` builds it into dist/), for `pip install <url>`."""
    path = settings.BASE_DIR / "dist" / MAHOUT_WHEEL
    if filename != MAHOUT_WHEEL or not path.is_file():
        return HttpResponse(
            f"No such download. This gateway offers {MAHOUT_WHEEL} once its operator has run `make mahout-wheel`.\n",
            status=404,
            content_type="text/plain",
        )
    return FileResponse(path.open("rb"), as_attachment=True, filename=MAHOUT_WHEEL, content_type="application/zip")


@login_required
@require_GET
def machines_status(request: AuthedHttpRequest) -> HttpResponse:
    """JSON the machines page polls every few seconds."""
    return JsonResponse({"hosts": selectors.host_statuses(user=request.user)})


def _owned_host(request: AuthedHttpRequest, host_id: int) -> Host:
    host = selectors.host_of(user=request.user, host_id=host_id)
    if host is None:
        raise Http404("No such machine.")
    return host


@login_required
@require_GET
def machine_detail(request: AuthedHttpRequest, host_id: int) -> HttpResponse:
    host = _owned_host(request, host_id)
    if request.GET.get("payouts") == "expired":
        messages.info(request, "The payout setup link expired: press \"Set up payouts\" again.")
    start, end = DateRangeForm(request.GET).range()
    daily = selectors.host_earnings_daily(host=host, start=start, end=end)
    return render(
        request,
        "web/machine_detail.html",
        {
            "host": host,
            "status": selectors.owner_status(host),
            "maintenance_by": selectors.maintenance_setter(host),
            "may_resume": hosts.owner_may_resume(host),
            "qualifications": selectors.qualifications_of(host=host),
            "chart": bar_chart(
                title="Earnings per day",
                points=[(row["day"].isoformat(), row["earned_ucents"]) for row in daily],
                fmt=usd,
            ),
            "statement": marketplace_selectors.host_statement(host=host),
            "reputation": reputation.reputation_of(host),
            "vest_days": settings.EARNINGS_VEST_SECONDS / 86400,
            "payout_form": PayoutForm(),
            "payout_profile": billing_selectors.payout_profile(host=host),
            "payouts_configured": stripe_api.payouts_configured(),
        },
    )


@login_required
@require_POST
def machine_payout_setup(request: AuthedHttpRequest, host_id: int) -> HttpResponse:
    """ "Set up payouts": off to Stripe's onboarding for the machine's payout account (its
    return URL is `machine_payout_return`), or back here when the account is ready."""
    host = _owned_host(request, host_id)
    page = request.build_absolute_uri(reverse("machine_detail", args=[host.pk]))
    try:
        link = billing.payout_account_onboard(
            host=host,
            return_url=request.build_absolute_uri(reverse("machine_payout_return", args=[host.pk])),
            refresh_url=f"{page}?payouts=expired",
        )
    except BillingError as error:
        messages.error(request, error.message)
        return redirect("machine_detail", host_id=host.pk)
    if link is None:
        messages.success(request, f"Payouts for {host.name} are set up: request one below.")
        return redirect("machine_detail", host_id=host.pk)
    return redirect(link)


@login_required
@require_GET
def machine_payout_return(request: AuthedHttpRequest, host_id: int) -> HttpResponse:
    """Where Stripe's onboarding sends the owner back: Stripe is asked whether it finished."""
    host = _owned_host(request, host_id)
    try:
        profile = billing.payout_account_refresh(host=host)
    except BillingError as error:
        messages.error(request, error.message)
    else:
        if profile is not None and profile.status == profile.Status.READY:
            messages.success(request, f"Payouts for {host.name} are set up: request one below.")
        else:
            messages.info(
                request, "Stripe's payout setup is not finished yet: press \"Set up payouts\" to continue it."
            )
    return redirect("machine_detail", host_id=host.pk)


@login_required
@require_POST
def machine_payout(request: AuthedHttpRequest, host_id: int) -> HttpResponse:
    host = _owned_host(request, host_id)
    form = PayoutForm(request.POST)
    if not form.is_valid():
        messages.error(request, "Enter an amount in USD, or leave it empty to withdraw everything available.")
        return redirect("machine_detail", host_id=host.pk)
    try:
        payout = billing.payout_request(host=host, amount_ucents=form.amount_ucents)
    except BillingError as error:
        messages.error(request, error.message)
    else:
        messages.success(request, f"Payout of {usd(payout.amount_ucents)} requested; an operator approves it.")
    return redirect("machine_detail", host_id=host.pk)


@login_required
@require_POST
def machine_resume(request: AuthedHttpRequest, host_id: int) -> HttpResponse:
    """The owner takes the machine out of maintenance, unless an operator or verification
    set it (or the machine is banned); back to the page the form was on."""
    host = _owned_host(request, host_id)
    try:
        resumed = hosts.host_maintenance_resume_by_owner(host=host)
    except (hosts.HostBanned, hosts.MaintenanceHeld) as error:
        messages.error(request, error.message)
    else:
        if resumed:
            messages.success(request, f"{host.name} is out of maintenance and takes work again.")
        else:
            messages.info(request, f"{host.name} was not in maintenance.")
    if request.POST.get("next") == "machines":
        return redirect("machines")
    return redirect("machine_detail", host_id=host.pk)


@login_required
@require_POST
def machine_token_rotate(request: AuthedHttpRequest, host_id: int) -> HttpResponse:
    """A new token for the machine, shown on this response only; the old one stops working
    at once (its open sockets are closed). Refused for a banned machine."""
    host = _owned_host(request, host_id)
    try:
        rotated = hosts.host_token_rotate(host=host)
    except hosts.HostBanned as error:
        messages.error(request, error.message)
        return redirect("machines")
    return _machines_page(request, form=HostForm(), new_host=rotated, rotated=True)


# --- operators ------------------------------------------------------------------------------


@staff_required
@require_GET
def pool(request: AuthedHttpRequest) -> HttpResponse:
    return render(
        request, "web/pool.html", {"pool": selectors.pool_overview(), "min_version": settings.MAHOUT_MIN_VERSION}
    )
