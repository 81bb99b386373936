"""Billing's HTTP API: top-ups (API key), host statement and payouts (host token),
customer usage (API key). Each view parses, calls one service or selector, renders.
"""
from __future__ import annotations

import csv
import io
import re
from datetime import date, timedelta

from django.conf import settings
from django.http import HttpResponse
from django.utils import timezone
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from billing import selectors, services
from billing.errors import BillingError
from billing.models import UCENTS_PER_CENT, Payout, TopUp
from hosts.apis import host_from_secret
from marketplace.apis import bearer_secret, key_from_secret
from marketplace.errors import ApiError, bad_request

ERROR_TYPES = {
    400: "invalid_request_error",
    402: "insufficient_quota",
    409: "conflict",
    429: "rate_limit_error",
    502: "api_error",
    503: "api_error",
}


def billing_api_error(error: BillingError) -> ApiError:
    """A billing refusal as an API error: the status and code come from the error class."""
    return ApiError(error.status, error.message, code=error.code, type=ERROR_TYPES.get(error.status, "api_error"))


class KeyAuthApi(APIView):
    def key(self, request):  # type: ignore[no-untyped-def]
        return key_from_secret(bearer_secret(request))


class HostAuthApi(APIView):
    def host(self, request):  # type: ignore[no-untyped-def]
        return host_from_secret(bearer_secret(request))


# --- top-ups ---------------------------------------------------------------------------


def topup_body(topup: TopUp) -> dict:
    return {
        "id": topup.pk,
        "object": "topup",
        "amount_cents": topup.amount_cents,
        "amount_ucents": topup.amount_ucents,
        "currency": topup.currency,
        "status": topup.status,
        "checkout_url": topup.checkout_url,
    }


class TopupCreateApi(KeyAuthApi):
    """POST {"amount_usd": "20.00"} → 201 with the Stripe Checkout URL to send the customer to.
    Credit arrives only when Stripe's webhook confirms the payment."""

    class InputSerializer(serializers.Serializer):
        amount_usd = serializers.DecimalField(max_digits=9, decimal_places=2, min_value=0)

    def post(self, request) -> Response:  # type: ignore[no-untyped-def]
        key = self.key(request)
        serializer = self.InputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        amount_cents = int(serializer.validated_data["amount_usd"] * 100)
        try:
            topup = services.topup_create(user=key.user, amount_cents=amount_cents)
        except BillingError as error:
            raise billing_api_error(error) from None
        return Response(topup_body(topup), status=201)


# --- hosts: statement and payouts ------------------------------------------------------------


def payout_body(payout: Payout) -> dict:
    return {
        "id": payout.pk,
        "object": "payout",
        "amount_ucents": payout.amount_ucents,
        "status": payout.status,
        "failure_reason": payout.failure_reason or None,
        "created_at": payout.created_at,
        "decided_at": payout.decided_at,
    }


class HostStatementApi(HostAuthApi):
    """GET → balance, available, payouts, and the latest completed jobs (tokens and
    earnings only: nothing about the customer)."""

    def get(self, request) -> Response:  # type: ignore[no-untyped-def]
        host = self.host(request)
        statement = selectors.host_statement(host=host)
        return Response(
            {
                "object": "host_statement",
                "balance_ucents": statement.balance_ucents,
                "available_ucents": statement.available_ucents,
                "pending_payout_ucents": statement.pending_payout_ucents,
                "paid_out_ucents": statement.paid_out_ucents,
                "payout_minimum_ucents": settings.PAYOUT_MINIMUM_UCENTS,
                "jobs": [
                    {
                        "job_id": job["pk"],
                        "model": job["model__name"],
                        "completion_tokens": job["completion_tokens"],
                        "earned_ucents": job["earned_ucents"],
                        "finished_at": job["finished_at"],
                    }
                    for job in statement.jobs
                ],
                "payouts": [payout_body(payout) for payout in statement.payouts],
            }
        )


class HostPayoutCreateApi(HostAuthApi):
    """POST {} (everything available) or {"amount_ucents": N} → 201 with a requested payout."""

    class InputSerializer(serializers.Serializer):
        amount_ucents = serializers.IntegerField(min_value=UCENTS_PER_CENT, required=False)

    def post(self, request) -> Response:  # type: ignore[no-untyped-def]
        host = self.host(request)
        serializer = self.InputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        try:
            payout = services.payout_request(host=host, amount_ucents=serializer.validated_data.get("amount_ucents"))
        except BillingError as error:
            raise billing_api_error(error) from None
        return Response(payout_body(payout), status=201)


# --- customer usage --------------------------------------------------------------------------

_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def _parse_day(raw: str | None, *, param: str, default: date) -> date:
    if raw is None or raw == "":
        return default
    try:
        if not _DATE.fullmatch(raw):
            raise ValueError
        return date.fromisoformat(raw)
    except ValueError:
        raise bad_request(f"'{param}' must be a date as YYYY-MM-DD, got {raw!r}.", code="invalid_date", param=param) from None


def usage_range(query) -> tuple[date, date]:  # type: ignore[no-untyped-def]
    """`from` and `to` (inclusive, UTC days); the last 30 days by default."""
    end = _parse_day(query.get("to"), param="to", default=timezone.now().date())
    start = _parse_day(query.get("from"), param="from", default=end - timedelta(days=29))
    if start > end:
        raise bad_request("'from' is after 'to'.", code="invalid_date", param="from")
    if (end - start).days + 1 > settings.USAGE_MAX_DAYS:
        raise bad_request(f"Ask for at most {settings.USAGE_MAX_DAYS} days at a time.", code="invalid_date", param="from")
    return start, end


def usage_row(row: dict) -> dict:
    return {
        "id": row["public_id"],
        "created": int(row["created_at"].timestamp()),
        "model": row["model__name"],
        "key_prefix": row["api_key__prefix"],
        "status": row["status"],
        "prompt_tokens": row["prompt_tokens"],
        "completion_tokens": row["completion_tokens"],
        "cost_ucents": row["cost_ucents"],
    }


def usage_page(query, *, user, start: date, end: date) -> tuple[list[dict], bool]:  # type: ignore[no-untyped-def]
    """One page of per-request rows: at most `limit` (1..USAGE_PAGE_MAX, default that) after
    the request id `after`; and whether more follow."""
    raw = query.get("limit") or str(settings.USAGE_PAGE_MAX)
    if not raw.isdigit() or not 1 <= int(raw) <= settings.USAGE_PAGE_MAX:
        raise bad_request(f"'limit' must be a whole number from 1 to {settings.USAGE_PAGE_MAX}, got {raw!r}.",
                          code="invalid_limit", param="limit")
    limit = int(raw)
    try:
        rows = list(selectors.usage_requests(user=user, start=start, end=end, after=query.get("after"))[: limit + 1])
    except selectors.UnknownCursor:
        raise bad_request(f"'after' names no request of yours: {query.get('after')!r}.", code="invalid_cursor", param="after") from None
    return [usage_row(row) for row in rows[:limit]], len(rows) > limit


class UsageApi(KeyAuthApi):
    """GET /v1/usage?from=YYYY-MM-DD&to=YYYY-MM-DD[&limit=N&after=ID] → daily totals, and the
    requests one page at a time (`has_more`; the next page starts `after` the last id)."""

    def get(self, request) -> Response:  # type: ignore[no-untyped-def]
        key = self.key(request)
        start, end = usage_range(request.query_params)
        data, has_more = usage_page(request.query_params, user=key.user, start=start, end=end)
        daily = selectors.usage_daily(user=key.user, start=start, end=end)
        return Response(
            {
                "object": "usage",
                "from": start.isoformat(),
                "to": end.isoformat(),
                "has_more": has_more,
                "last_id": data[-1]["id"] if data else None,
                "total_cost_ucents": sum(day["cost_ucents"] or 0 for day in daily),
                "daily": [
                    {
                        "date": day["day"].isoformat(),
                        "requests": day["requests"],
                        "prompt_tokens": day["prompt_tokens"] or 0,
                        "completion_tokens": day["completion_tokens"] or 0,
                        "cost_ucents": day["cost_ucents"] or 0,
                    }
                    for day in daily
                ],
                "data": data,
            }
        )


CSV_COLUMNS = ["id", "created", "model", "key_prefix", "status", "prompt_tokens", "completion_tokens", "cost_ucents"]


class UsageCsvApi(KeyAuthApi):
    """GET /v1/usage.csv?from=…&to=… → one line per request (same columns as /v1/usage's data)."""

    def get(self, request) -> HttpResponse:  # type: ignore[no-untyped-def]
        key = self.key(request)
        start, end = usage_range(request.query_params)
        return usage_csv_response(user=key.user, start=start, end=end)


def usage_csv_response(*, user, start, end) -> HttpResponse:  # type: ignore[no-untyped-def]
    """One CSV line per request of `user` in [start, end]; the API and the web page both serve this."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in selectors.usage_requests(user=user, start=start, end=end).iterator(chunk_size=2000):
        writer.writerow(usage_row(row))
    response = HttpResponse(out.getvalue(), content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="usage-{start.isoformat()}-{end.isoformat()}.csv"'
    return response
