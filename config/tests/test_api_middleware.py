"""Django's own middleware on the async gateway: the API's paths go past what only pages need,
the computing middleware still shape every response, and pages keep sessions and CSRF."""

from __future__ import annotations

from typing import TYPE_CHECKING
from unittest import mock

import pytest
from asgiref.sync import async_to_sync
from asgiref.testing import ApplicationCommunicator
from django.core.handlers import asgi as django_asgi
from django.test import AsyncClient

if TYPE_CHECKING:
    from testkit.personas import Customer

pytestmark = pytest.mark.django_db(transaction=True)  # views run ORM calls on their own threads


def test_api_answer_has_security_headers_and_no_session(customer: Customer) -> None:
    client = AsyncClient(enforce_csrf_checks=True)
    response = async_to_sync(client.get)("/v1/models", headers={"Authorization": f"Bearer {customer.secret}"})
    assert response.status_code == 200
    assert response["X-Content-Type-Options"] == "nosniff"  # SecurityMiddleware, in the event loop
    assert response["X-Frame-Options"] == "DENY"  # XFrameOptionsMiddleware, in the event loop
    assert "sessionid" not in response.cookies and "csrftoken" not in response.cookies
    assert "Cookie" not in response.get("Vary", "")  # no session was read


def test_api_post_needs_no_csrf_token_even_with_a_session_cookie() -> None:
    client = AsyncClient(enforce_csrf_checks=True)
    client.cookies["sessionid"] = "whatever"
    response = async_to_sync(client.post)(
        "/v1/chat/completions",
        data={"model": "nope", "messages": []},
        content_type="application/json",
        headers={"Authorization": "Bearer sk-wrong"},
    )
    assert response.status_code == 401  # the key's refusal, not CSRF's 403


def test_pages_still_check_csrf() -> None:
    client = AsyncClient(enforce_csrf_checks=True)
    response = async_to_sync(client.post)("/signup/", data={"email": "x@example.com"})
    assert response.status_code == 403


def test_pages_still_have_sessions(customer: Customer) -> None:
    client = AsyncClient()
    async_to_sync(client.aforce_login)(customer.user)
    response = async_to_sync(client.get)("/")
    assert response.status_code == 200  # the dashboard, not a redirect to sign in
    assert response.asgi_request.user == customer.user
    assert response["X-Frame-Options"] == "DENY"


async def asgi_get(path: str) -> int:
    from config.asgi import django_asgi as handler

    scope = {
        "type": "http",
        "method": "GET",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [],
        "server": ("testserver", 80),
        "client": ("127.0.0.1", 1),
        "scheme": "http",
        "root_path": "",
        "http_version": "1.1",
    }
    app = ApplicationCommunicator(handler, scope)
    await app.send_input({"type": "http.request", "body": b"", "more_body": False})
    start = await app.receive_output(10)
    await app.receive_output(10)  # the body
    await app.wait(10)
    return start["status"]


def test_django_starts_a_thread_for_pages_only() -> None:
    """An API request gets no thread of its own (its database work runs on core.db's pool);
    a page still does (its view is sync)."""
    contexts = []
    real = django_asgi.ThreadSensitiveContext

    def counted() -> object:
        contexts.append(1)
        return real()

    with mock.patch.object(django_asgi, "ThreadSensitiveContext", counted):
        assert async_to_sync(asgi_get)("/v1/models") == 401
        assert contexts == []
        assert async_to_sync(asgi_get)("/login/") == 200
        assert contexts == [1]


def test_the_stock_middleware_is_all_there_as_subclasses() -> None:
    """The deploy checks silenced in settings (security.W001-W003) look for the stock paths;
    this holds the subclasses to the same promise."""
    from django.conf import settings
    from django.middleware.clickjacking import XFrameOptionsMiddleware
    from django.middleware.csrf import CsrfViewMiddleware
    from django.middleware.security import SecurityMiddleware
    from django.utils.module_loading import import_string

    classes = [import_string(path) for path in settings.MIDDLEWARE]
    for stock in (SecurityMiddleware, XFrameOptionsMiddleware, CsrfViewMiddleware):
        assert any(issubclass(cls, stock) for cls in classes), stock


async def asgi_post(path: str, body: bytes, *, token: str) -> int:
    from config.asgi import django_asgi as handler

    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"authorization", f"Bearer {token}".encode())],
        "server": ("testserver", 80),
        "client": ("127.0.0.1", 1),
        "scheme": "http",
        "root_path": "",
        "http_version": "1.1",
    }
    app = ApplicationCommunicator(handler, scope)
    await app.send_input({"type": "http.request", "body": body, "more_body": False})
    start = await app.receive_output(20)
    await app.receive_output(20)  # the body
    await app.wait(20)
    return start["status"]


def test_a_slow_sync_api_view_holds_up_no_other(monkeypatch) -> None:
    """Two sync API calls (DRF views) at once, the first waiting until the second has run: on
    asgiref's one shared thread the second would wait behind the first."""
    import asyncio
    import threading

    from core.errors import ApiError
    from hosts.apis import HostApi

    second_ran = threading.Event()
    calls: list[int] = []
    first_saw_it: list[bool] = []

    def host(self: HostApi, request: object) -> None:
        calls.append(len(calls))
        if len(calls) == 1:
            first_saw_it.append(second_ran.wait(10))  # the first call: a slow one (a row lock, say)
        else:
            second_ran.set()
        raise ApiError(401, "no host here", code="invalid_host_token")

    monkeypatch.setattr(HostApi, "host", host)

    async def both() -> list[int]:
        first = asyncio.ensure_future(asgi_post("/hosts/api/heartbeat", b"{}", token="host-a"))
        await asyncio.sleep(0.2)  # the first is inside its view
        return [await asgi_post("/hosts/api/heartbeat", b"{}", token="host-b"), await first]

    assert async_to_sync(both)() == [401, 401]
    assert first_saw_it == [True], "the second call ran while the first was still in its view"


def test_the_schema_is_generated_once_per_process(monkeypatch) -> None:
    from drf_spectacular.generators import SchemaGenerator

    from core.openapi import CachedSchemaGenerator

    monkeypatch.setattr(CachedSchemaGenerator, "kept", {})
    generated: list[int] = []
    real = SchemaGenerator.get_schema

    def counted(self: SchemaGenerator, request: object = None, public: bool = False) -> dict:
        generated.append(1)
        return real(self, request=request, public=public)

    monkeypatch.setattr(SchemaGenerator, "get_schema", counted)
    client = AsyncClient()
    first, second = (async_to_sync(client.get)("/api/schema/") for _ in range(2))
    yaml = async_to_sync(client.get)("/api/schema/?format=yaml")
    assert first.status_code == second.status_code == yaml.status_code == 200
    assert first.content == second.content and b"openapi: 3.1.0" in yaml.content
    assert generated == [1]
    for version in range(20):  # a caller's own ?version= values each generate, but are not all kept
        async_to_sync(client.get)(f"/api/schema/?version=v{version}")
    assert len(CachedSchemaGenerator.kept) <= CachedSchemaGenerator.KEEP + 1  # (and the plain one)
    async_to_sync(client.get)("/api/schema/")
    assert len(generated) == 21, "the plain one is still kept"
