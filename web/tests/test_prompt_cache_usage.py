"""Issue 53 on the customer's usage page: each request's cached prompt tokens (those admission
found cached and billed at the cached price) in its own column, their total for the range,
and a cached_tokens column at the end of the CSV."""

from __future__ import annotations

import csv
import io
import re
from typing import TYPE_CHECKING

import pytest

from conftest import make_customer
from marketplace.models import Request
from web.tests.factories import finished_request

if TYPE_CHECKING:
    from testkit.personas import Customer

pytestmark = pytest.mark.django_db


def cached_request(customer: Customer, cached_tokens: int) -> Request:
    request = finished_request(customer=customer)  # 7 prompt tokens
    Request.objects.filter(pk=request.pk).update(cached_tokens=cached_tokens)
    return request


class UsagePageCacheTests:
    def test_each_request_shows_its_cached_tokens_and_the_range_their_total(self, customer, customer_client) -> None:
        cached = cached_request(customer, 6)
        uncached = cached_request(customer, 0)
        cached_request(make_customer(), 5)  # someone else's
        page = customer_client.get("/usage/").content.decode()
        recent = page[page.index('id="recent"') :]
        assert "<th class=\"num\" title=" in recent and ">Cached</th>" in recent
        for request, count in ((cached, 6), (uncached, 0)):
            row = recent[recent.index(request.public_id) :]
            assert re.search(rf'<td class="num">7</td>\s*<td class="num cached">{count}</td>', row)
        totals = page[page.index('id="usage-totals"') :].split("</p>")[0]
        assert re.search(r'<span id="usage-cached">6</span> of the prompts\' tokens cached', totals)

    def test_a_range_with_nothing_cached_says_nothing_of_it(self, customer, customer_client) -> None:
        cached_request(customer, 0)
        page = customer_client.get("/usage/").content.decode()
        assert 'id="usage-cached"' not in page

    @pytest.mark.django_db(transaction=True)  # the CSV is read by the async server's database threads
    def test_the_csv_ends_with_the_cached_tokens_column(self, customer, customer_client) -> None:
        cached = cached_request(customer, 6)
        text = b"".join(customer_client.get("/usage/csv/")).decode()
        header = text.splitlines()[0].split(",")
        assert header[:3] == ["id", "created", "model"] and header[-1] == "cached_tokens"
        assert [(r["id"], r["cached_tokens"]) for r in csv.DictReader(io.StringIO(text))] == [(cached.public_id, "6")]
