"""Customer usage: daily totals and per-request rows, as JSON pages or one CSV."""

from __future__ import annotations

import csv
import io
import re
from collections.abc import AsyncIterator, Mapping
from datetime import date
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.http import QueryDict, StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from accounts.apis import KeyApi
from accounts.selectors import key_scope
from core.dates import day_range
from core.db import db
from core.errors import bad_request
from marketplace import selectors

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from accounts.models import ApiKey

_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def _parse_day(raw: str | None, *, param: str) -> date | None:
    if raw is None or raw == "":
        return None
    try:
        if not _DATE.fullmatch(raw):
            raise ValueError
        return date.fromisoformat(raw)
    except ValueError:
        raise bad_request(
            f"'{param}' must be a date as YYYY-MM-DD, got {raw!r}.", code="invalid_date", param=param
        ) from None


def usage_range(query: QueryDict) -> tuple[date, date]:
    """`from` and `to` (inclusive, UTC days); the last 30 days by default."""
    end = _parse_day(query.get("to"), param="to")
    return day_range(_parse_day(query.get("from"), param="from"), end)


def usage_row(row: Mapping[str, Any]) -> dict:
    return {
        "id": row["public_id"],
        "created": int(row["created_at"].timestamp()),
        "model": row["model__name"],
        "key_prefix": row["api_key__prefix"],
        "status": row["status"],
        "prompt_tokens": row["prompt_tokens"],
        "completion_tokens": row["completion_tokens"],
        "cost_ucents": row["cost_ucents"],
        "cached_tokens": row["cached_tokens"],
    }


def usage_page(
    query: QueryDict, *, user: User, start: date, end: date, api_key: ApiKey | None = None
) -> tuple[list[dict], bool]:
    """One page of per-request rows: at most `limit` (1..USAGE_PAGE_MAX, default that) after
    the request id `after`; and whether more follow."""
    raw = query.get("limit") or str(settings.USAGE_PAGE_MAX)
    if not raw.isdigit() or not 1 <= int(raw) <= settings.USAGE_PAGE_MAX:
        raise bad_request(
            f"'limit' must be a whole number from 1 to {settings.USAGE_PAGE_MAX}, got {raw!r}.",
            code="invalid_limit",
            param="limit",
        )
    limit = int(raw)
    try:
        rows = list(
            selectors.usage_requests(user=user, start=start, end=end, after=query.get("after"), api_key=api_key)[
                : limit + 1
            ]
        )
    except selectors.UnknownCursor:
        raise bad_request(
            f"'after' names no request of yours: {query.get('after')!r}.", code="invalid_cursor", param="after"
        ) from None
    return [usage_row(row) for row in rows[:limit]], len(rows) > limit


RANGE = [
    OpenApiParameter("from", OpenApiTypes.DATE, description="first UTC day (default: 30 days before `to`)"),
    OpenApiParameter("to", OpenApiTypes.DATE, description="last UTC day, inclusive (default: today)"),
]


class UsageApi(KeyApi):
    """GET /v1/usage?from=YYYY-MM-DD&to=YYYY-MM-DD[&limit=N&after=ID] → daily totals, and the
    requests one page at a time (`has_more`; the next page starts `after` the last id)."""

    class OutputSerializer(serializers.Serializer):
        class DaySerializer(serializers.Serializer):
            date = serializers.DateField()
            requests = serializers.IntegerField()
            prompt_tokens = serializers.IntegerField()
            completion_tokens = serializers.IntegerField()
            cost_ucents = serializers.IntegerField()

        class RowSerializer(serializers.Serializer):
            """One request (`usage_row`); the CSV has the same columns."""

            id = serializers.CharField()
            created = serializers.IntegerField(help_text="Unix seconds")
            model = serializers.CharField()
            key_prefix = serializers.CharField()
            status = serializers.CharField()
            prompt_tokens = serializers.IntegerField()
            completion_tokens = serializers.IntegerField()
            cost_ucents = serializers.IntegerField()
            cached_tokens = serializers.IntegerField(
                help_text="of prompt_tokens, those billed at the model's cached input price (docs/money.md)"
            )

        object = serializers.CharField(help_text="usage")
        to = serializers.DateField()
        has_more = serializers.BooleanField()
        last_id = serializers.CharField(allow_null=True)
        total_cost_ucents = serializers.IntegerField()
        daily = DaySerializer(many=True)
        # (OpenAI's field `data`: DRF's stubs take the name for Serializer.data)
        data = RowSerializer(many=True)  # type: ignore[assignment]

        def get_fields(self) -> dict:
            return {"from": serializers.DateField(), **super().get_fields()}  # a Python keyword: no class attribute

    @extend_schema(
        parameters=[
            *RANGE,
            OpenApiParameter(
                "limit", OpenApiTypes.INT, description=f"requests per page, 1 to {settings.USAGE_PAGE_MAX}"
            ),
            OpenApiParameter("after", OpenApiTypes.STR, description="the `last_id` of the previous page"),
        ],
        responses={200: OutputSerializer},
    )
    def get(self, request: Request) -> Response:
        key = self.key(request)
        start, end = usage_range(request.query_params)
        data, has_more = usage_page(request.query_params, user=key.user, start=start, end=end, api_key=key_scope(key))
        daily = selectors.usage_daily(user=key.user, start=start, end=end, api_key=key_scope(key))
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


CSV_COLUMNS = [
    "id",
    "created",
    "model",
    "key_prefix",
    "status",
    "prompt_tokens",
    "completion_tokens",
    "cost_ucents",
    "cached_tokens",  # last: a column added later, so a reader that counts columns still finds the others
]


class UsageCsvApi(KeyApi):
    """GET /v1/usage.csv?from=…&to=… → one line per request (same columns as /v1/usage's data)."""

    @extend_schema(parameters=RANGE, responses={(200, "text/csv"): OpenApiTypes.STR})
    def get(self, request: Request) -> StreamingHttpResponse:
        key = self.key(request)
        start, end = usage_range(request.query_params)
        return usage_csv_response(user=key.user, start=start, end=end, api_key=key_scope(key))


CSV_PAGE = 2000  # requests read (and sent) per page of the CSV


def usage_csv_response(*, user: User, start: date, end: date, api_key: ApiKey | None = None) -> StreamingHttpResponse:
    """One CSV line per request of `user` in [start, end]; the API and the web page both
    serve this. Streamed a page at a time (an asynchronous iterator, so the ASGI server
    sends each page as it is read): a year of requests is never held in memory."""
    response = StreamingHttpResponse(
        _csv_pages(user=user, start=start, end=end, api_key=api_key), content_type="text/csv; charset=utf-8"
    )
    response["Content-Disposition"] = f'attachment; filename="usage-{start.isoformat()}-{end.isoformat()}.csv"'
    return response


def _csv_page(
    *, user: User, start: date, end: date, after: str | None, api_key: ApiKey | None
) -> list[Mapping[str, Any]]:
    return list(selectors.usage_requests(user=user, start=start, end=end, after=after, api_key=api_key)[:CSV_PAGE])


async def _csv_pages(*, user: User, start: date, end: date, api_key: ApiKey | None = None) -> AsyncIterator[str]:
    yield ",".join(CSV_COLUMNS) + "\n"
    after = None
    while True:
        rows = await db(_csv_page, user=user, start=start, end=end, after=after, api_key=api_key)
        if not rows:
            return
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS, lineterminator="\n")
        for row in rows:
            writer.writerow(usage_row(row))
        yield out.getvalue()
        if len(rows) < CSV_PAGE:
            return
        after = rows[-1]["public_id"]
