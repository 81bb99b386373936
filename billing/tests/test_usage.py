from __future__ import annotations

import csv
import io
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import pytest
from django.test import Client

from conftest import make_customer
from marketplace.models import Request
from testkit.requests import submit_request

if TYPE_CHECKING:
    from catalog.models import CatalogModel
    from testkit.personas import Customer

pytestmark = pytest.mark.django_db


def request_on(customer: Customer, catalog: CatalogModel, day: str, *, cost: int, completion_tokens: int) -> Request:
    request = submit_request(customer, catalog, max_tokens=10, prompt_tokens=4)
    created = datetime.fromisoformat(day).replace(hour=12, tzinfo=UTC)
    Request.objects.filter(pk=request.pk).update(
        created_at=created, status="completed", cost_ucents=cost, completion_tokens=completion_tokens
    )
    return request


class UsageApiTests:
    def test_it_lists_requests_and_daily_totals_in_the_range(self, catalog) -> None:
        customer = make_customer()
        a = request_on(customer, catalog, "2026-03-01", cost=440, completion_tokens=10)
        b = request_on(customer, catalog, "2026-03-01", cost=120, completion_tokens=2)
        c = request_on(customer, catalog, "2026-03-03", cost=80, completion_tokens=1)
        request_on(customer, catalog, "2026-03-05", cost=999, completion_tokens=9)  # outside
        request_on(make_customer(), catalog, "2026-03-01", cost=777, completion_tokens=7)  # someone else's
        response = Client().get(
            "/v1/usage?from=2026-03-01&to=2026-03-04", HTTP_AUTHORIZATION=f"Bearer {customer.secret}"
        )
        assert response.status_code == 200, response.content
        body = response.json()
        assert [row["id"] for row in body["data"]] == [a.public_id, b.public_id, c.public_id]
        assert body["daily"] == [
            {"date": "2026-03-01", "requests": 2, "prompt_tokens": 8, "completion_tokens": 12, "cost_ucents": 560},
            {"date": "2026-03-03", "requests": 1, "prompt_tokens": 4, "completion_tokens": 1, "cost_ucents": 80},
        ]
        assert body["total_cost_ucents"] == 640

    def test_it_pages_the_requests_after_a_cursor_and_says_when_more_follow(self, catalog) -> None:
        customer = make_customer()
        made = [
            request_on(customer, catalog, "2026-03-01", cost=10 * i, completion_tokens=i).public_id for i in range(5)
        ]
        auth = {"HTTP_AUTHORIZATION": f"Bearer {customer.secret}"}
        seen, after, pages = [], "", 0
        while True:
            body = Client().get(f"/v1/usage?from=2026-03-01&to=2026-03-01&limit=2&after={after}", **auth).json()
            seen += [row["id"] for row in body["data"]]
            pages += 1
            assert (
                body["total_cost_ucents"] == 100 and body["daily"][0]["requests"] == 5
            )  # totals cover the whole range
            if not body["has_more"]:
                break
            after = body["last_id"]
        assert seen == made and pages == 3

    @pytest.mark.parametrize(
        ("query", "code"),
        [
            ("limit=0", "invalid_limit"),
            ("limit=1001", "invalid_limit"),
            ("limit=two", "invalid_limit"),
            ("after=chatcmpl-nobody", "invalid_cursor"),
        ],
    )
    def test_it_answers_400_for_a_bad_page(self, catalog, query: str, code: str) -> None:
        customer = make_customer()
        other = request_on(make_customer(), catalog, "2026-03-01", cost=1, completion_tokens=1)
        for q in (
            (query, f"after={other.public_id}") if code == "invalid_cursor" else (query,)
        ):  # another's id is no cursor
            response = Client().get(f"/v1/usage?{q}", HTTP_AUTHORIZATION=f"Bearer {customer.secret}")
            assert response.status_code == 400 and response.json()["error"]["code"] == code, response.content

    @pytest.mark.django_db(transaction=True)  # the CSV is read by the async server's database threads
    def test_it_exports_the_same_rows_as_csv(self, catalog) -> None:
        customer = make_customer()
        a = request_on(customer, catalog, "2026-03-01", cost=440, completion_tokens=10)
        response = Client().get(
            "/v1/usage.csv?from=2026-03-01&to=2026-03-01", HTTP_AUTHORIZATION=f"Bearer {customer.secret}"
        )
        assert response.status_code == 200 and response["Content-Type"].startswith("text/csv")
        rows = list(csv.DictReader(io.StringIO(b"".join(response).decode())))
        assert [(r["id"], r["cost_ucents"], r["completion_tokens"]) for r in rows] == [(a.public_id, "440", "10")]

    @pytest.mark.django_db(transaction=True)  # the CSV is read by the async server's database threads
    def test_the_csv_is_streamed_a_page_at_a_time_and_loses_no_row(self, catalog, monkeypatch) -> None:
        from marketplace.openai import usage_apis

        monkeypatch.setattr(usage_apis, "CSV_PAGE", 2)
        customer = make_customer()
        made = [request_on(customer, catalog, "2026-03-01", cost=1, completion_tokens=1).public_id for _ in range(5)]
        response = Client().get(
            "/v1/usage.csv?from=2026-03-01&to=2026-03-01", HTTP_AUTHORIZATION=f"Bearer {customer.secret}"
        )
        pieces = [piece.decode() for piece in response]
        assert len(pieces) == 1 + 3, "the header, then three pages of at most two requests"
        assert [row["id"] for row in csv.DictReader(io.StringIO("".join(pieces)))] == made

    @pytest.mark.parametrize(
        "query", ["from=2026-3-1", "from=20260301", "to=2026-02-30", "from=2026-03-05&to=2026-03-01", "from=yesterday"]
    )
    def test_it_answers_400_in_openai_format_for_bad_dates(self, catalog, query: str) -> None:
        customer = make_customer()
        for path in ("/v1/usage", "/v1/usage.csv"):
            response = Client().get(f"{path}?{query}", HTTP_AUTHORIZATION=f"Bearer {customer.secret}")
            assert response.status_code == 400
            assert response.json()["error"]["code"] == "invalid_date"

    def test_it_refuses_without_a_key(self, catalog) -> None:
        assert Client().get("/v1/usage").status_code == 401
