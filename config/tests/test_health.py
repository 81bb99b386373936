"""`GET /healthz`, the load balancer's health check: no key, no database, nothing written."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext


@pytest.mark.django_db
class HealthTests:
    def test_it_answers_200_without_a_key_and_without_touching_the_database(self) -> None:
        with CaptureQueriesContext(connection) as queries:
            response = Client().get("/healthz")
        assert response.status_code == 200 and response.json() == {"status": "ok"}
        assert list(queries) == []

    def test_it_takes_get_and_head_only(self) -> None:
        assert Client().head("/healthz").status_code == 200
        assert Client().post("/healthz").status_code == 405
