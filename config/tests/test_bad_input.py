"""Bad input is a refusal in the API's format, never a server error: ids past 64 bits, NUL
characters (PostgreSQL's text and jsonb hold none), numbers past a column's range, and paths
that name nothing. Each case here was a 500 on PostgreSQL or SQLite (found while fuzzing the
API against its schema, config/tests/test_schema_fuzz.py)."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from conftest import make_customer

pytestmark = pytest.mark.django_db(transaction=True)

HUGE = 2**70  # past any 64-bit column
BIG = 2**40  # past a 32-bit column
NUL = "a\x00b"
CHAT = {"model": "gemma-3-270m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

HOST_POSTS = [
    (f"/hosts/api/jobs/{HUGE}/tokens", {"seq": 0, "text": "x"}, 404),
    (f"/hosts/api/jobs/{HUGE}/complete", {"finish_reason": "stop"}, 404),
    ("/hosts/api/jobs/1/tokens", {"seq": HUGE, "text": "x"}, 400),
    (f"/api/rings/{HUGE}/stats", {"stages": [{"stage": 0, "hold_s": 1, "idle_s": 1, "queue_depth": 1}]}, 404),
    ("/api/rings/own", {"model": "gemma-3-270m", "stages": 2, "row_width": BIG, "micro_batch": 1}, 400),
    ("/api/moe/coordinator-report", {"model": "m", "busy": BIG}, 400),
    (
        "/hosts/api/qualifications",
        {
            "model": "gemma-3-270m",
            "fingerprint": "f",
            "machine": {"cpu": NUL},
            "benchmark": {"prompt_tps": 1, "gen_tps": 1, "ttft_ms": 1, "memory_mb": 1},
        },
        400,
    ),
    (
        "/hosts/api/qualifications",
        {
            "model": "gemma-3-270m",
            "fingerprint": "f",
            "benchmark": {"prompt_tps": 1, "gen_tps": 1, "ttft_ms": 1, "memory_mb": 1, "threads": BIG},
        },
        400,
    ),
]
CUSTOMER_POSTS = [
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": NUL}]}, "messages[0].content"),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": NUL}]}]},
        "messages[0].content",
    ),
    ("/v1/chat/completions", {**CHAT, "stop": [NUL]}, "stop"),
    (
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": NUL, "schema": {}}}},
        "response_format",
    ),
    ("/v1/completions", {"model": "gemma-3-270m", "prompt": NUL}, "prompt"),
    ("/v1/embeddings", {"model": "all-minilm-l6-v2", "input": ["ok", NUL]}, "input"),
]
CUSTOMER_GETS = [
    ("/v1/generation?id=a%00b", 404),
    ("/v1/chat/completions/a%00b?stream=true", 404),
    ("/v1/usage?after=a%00b", 400),
    (f"/v1/completions/{'x' * 3000}?stream=true", 404),
]


def error_of(response) -> dict:
    assert response["Content-Type"].startswith("application/json"), response.content[:200]
    return response.json()["error"]


class BadInputTests:
    @pytest.mark.parametrize(("path", "body", "status"), HOST_POSTS)
    def test_it_is_refused_at_the_host_doors(self, serving_host, path, body, status) -> None:
        response = Client().post(
            path,
            data=json.dumps(body),
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {serving_host.token}",
        )
        assert response.status_code == status, response.content[:300]
        assert error_of(response)["code"]

    @pytest.mark.parametrize(("path", "body", "param"), CUSTOMER_POSTS)
    def test_a_nul_character_is_refused_before_anything_is_queued(self, customer, path, body, param) -> None:
        from marketplace.models import Request

        response = Client().post(
            path, data=json.dumps(body), content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {customer.secret}"
        )
        assert response.status_code == 400, response.content[:300]
        assert (error_of(response)["param"], error_of(response)["message"]) == (
            param,
            f"'{param}': Null characters are not allowed.",
        )
        assert not Request.objects.exists()

    @pytest.mark.parametrize(("path", "status"), CUSTOMER_GETS)
    def test_an_id_that_names_nothing_is_not_found(self, customer, path, status) -> None:
        response = Client().get(path, HTTP_AUTHORIZATION=f"Bearer {customer.secret}")
        assert response.status_code == status, response.content[:300]
        assert error_of(response)["code"] in ("not_found", "invalid_cursor")

    @pytest.mark.parametrize(
        "path", ["/v1/nothing", "/hosts/api/jobs/abc/tokens", "/api/rings/-1/stats", "/billing/api/none"]
    )
    def test_an_api_path_that_names_nothing_is_a_404_in_the_api_format(self, path) -> None:
        response = Client().post(path, data="{}", content_type="application/json")
        assert response.status_code == 404
        assert error_of(response)["code"] == "not_found"

    @pytest.mark.parametrize("host", ["^?0", "evil.example.com"])
    def test_a_host_header_django_refuses_is_a_400_in_the_api_format_on_an_api_path(self, host) -> None:
        response = Client().get("/api/expert-demand", HTTP_HOST=host)  # the fuzzer's find: an HTML 400 before
        assert response.status_code == 400
        assert error_of(response)["code"] == "bad_request"
        page = Client().get("/", HTTP_HOST=host)
        assert page.status_code == 400 and page["Content-Type"].startswith("text/html")

    def test_a_page_that_names_nothing_is_still_the_sites_page(self) -> None:
        response = Client().get("/no-such-page/")
        assert response.status_code == 404 and response["Content-Type"].startswith("text/html")

    def test_a_web_page_id_past_64_bits_is_not_found(self, catalog) -> None:
        client = Client()
        client.force_login(make_customer().user)
        assert client.post(f"/keys/{HUGE}/revoke/").status_code == 404
