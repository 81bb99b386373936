"""Keys' "Last used": recorded on the API's authentication path, at most one write a minute."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from accounts.key_use import LAST_USED_RESOLUTION, api_key_used
from accounts.models import ApiKey

pytestmark = pytest.mark.django_db


def call(secret: str) -> int:
    """GET /v1/credits: a call that authenticates its key."""
    return Client().get("/v1/credits", HTTP_AUTHORIZATION=f"Bearer {secret}").status_code


def key_writes(queries: CaptureQueriesContext) -> list[str]:
    return [
        q["sql"] for q in queries.captured_queries if q["sql"].startswith("UPDATE") and "marketplace_apikey" in q["sql"]
    ]


class LastUsedTests:
    def test_it_records_a_request_on_a_key_never_used(self, customer) -> None:
        assert ApiKey.objects.get(pk=customer.key.pk).last_used_at is None
        before = timezone.now()
        assert call(customer.secret) == 200
        used = ApiKey.objects.get(pk=customer.key.pk).last_used_at
        assert used is not None and before <= used <= timezone.now()

    def test_it_writes_nothing_for_a_second_request_within_the_minute(self, customer) -> None:
        assert call(customer.secret) == 200
        first = ApiKey.objects.get(pk=customer.key.pk).last_used_at
        with CaptureQueriesContext(connection) as queries:
            assert call(customer.secret) == 200
        assert key_writes(queries) == []
        assert ApiKey.objects.get(pk=customer.key.pk).last_used_at == first

    def test_it_writes_again_once_the_stored_time_is_a_minute_old(self, customer) -> None:
        old = timezone.now() - LAST_USED_RESOLUTION - timedelta(seconds=1)
        ApiKey.objects.filter(pk=customer.key.pk).update(last_used_at=old)
        with CaptureQueriesContext(connection) as queries:
            assert call(customer.secret) == 200
        assert len(key_writes(queries)) == 1
        assert ApiKey.objects.get(pk=customer.key.pk).last_used_at > old

    def test_a_refused_key_records_nothing(self, customer) -> None:
        ApiKey.objects.filter(pk=customer.key.pk).update(revoked_at=timezone.now())
        assert call(customer.secret) == 401
        assert ApiKey.objects.get(pk=customer.key.pk).last_used_at is None


class ApiKeyUsedTests:
    def test_it_lets_one_of_two_stale_copies_write(self, customer) -> None:
        """Two requests that loaded the key before either wrote: the UPDATE's own condition
        lets the first through and stops the second (someone else got there first)."""
        first, second = ApiKey.objects.get(pk=customer.key.pk), ApiKey.objects.get(pk=customer.key.pk)
        now = timezone.now()
        assert api_key_used(key=first, now=now) is True
        assert api_key_used(key=second, now=now + timedelta(seconds=5)) is False
        assert ApiKey.objects.get(pk=customer.key.pk).last_used_at == now

    def test_it_skips_the_query_when_the_loaded_row_is_recent(self, customer) -> None:
        key = ApiKey.objects.get(pk=customer.key.pk)
        now = timezone.now()
        api_key_used(key=key, now=now)
        with CaptureQueriesContext(connection) as queries:
            assert api_key_used(key=key, now=now + timedelta(seconds=30)) is False
        assert queries.captured_queries == []
