"""Every HTTP body is bounded while it is read, before authentication (issue 17), on the real
ASGI server: a declared length over the limit and a chunked body that grows past it are both
a 413 in the API's error format, never parsed, never a 500."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from django.conf import settings

pytestmark = pytest.mark.e2e

LIMIT = settings.DATA_UPLOAD_MAX_MEMORY_SIZE


def chunks(total: int, size: int = 64 * 1024):  # noqa: ANN201 - a generator body: httpx sends it chunked
    sent = 0
    while sent < total:
        piece = min(size, total - sent)
        sent += piece
        yield b"x" * piece


def error_code(response: httpx.Response) -> str:
    return response.json()["error"]["code"]


class BodyLimitTests:
    @pytest.mark.parametrize("path", ["/v1/chat/completions", "/hosts/api/claim", "/accounts/login/"])
    def test_a_chunked_body_past_the_limit_is_refused_before_anyone_is_authenticated(self, gateway, path) -> None:
        try:
            response = httpx.post(f"{gateway.url}{path}", content=chunks(LIMIT * 4), timeout=30)
        except httpx.RemoteProtocolError:  # the server may close while the client still writes
            pytest.fail("the gateway closed the connection without its 413")
        assert response.status_code == 413 and error_code(response) == "body_too_large"

    def test_a_declared_length_over_the_limit_is_refused_without_reading_it(self, gateway) -> None:
        host, port = gateway.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as raw:  # (daphne itself waits for the whole body)
            raw.sendall(
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Length: {LIMIT + 1}\r\n"
                "Content-Type: application/json\r\n\r\n".encode()
                + b"{" * (LIMIT + 1)
            )
            answer = b""
            while b"}}" not in answer:
                piece = raw.recv(4096)
                if not piece:
                    break
                answer += piece
        head, _, body = answer.decode().partition("\r\n\r\n")
        assert head.startswith("HTTP/1.1 413") and json.loads(body)["error"]["code"] == "body_too_large"

    def test_a_body_within_the_limit_reaches_the_view(self, gateway) -> None:
        response = httpx.post(f"{gateway.url}/v1/chat/completions", content=chunks(1000), timeout=30)
        assert response.status_code == 401 and error_code(response) == "missing_api_key"
