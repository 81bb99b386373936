"""The gateway's own middleware: WhiteNoise made async-capable, and request ids.

WhiteNoise as an async-capable middleware.

WhiteNoise's middleware is sync-only, so Django ran every request of the async
gateway (every host batch, every customer stream) through a sync/async thread hop
just to ask whether the path was a static file. Here the same lookup runs inline:
static files are answered by WhiteNoise itself, anything else goes straight on to
the async handler.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import HttpRequest, HttpResponseBase
from whitenoise.middleware import WhiteNoiseMiddleware


class AsyncCapable:
    """Django's async-capable middleware contract in one place: serve the async chain
    without a thread hop (`_async`: whether `get_response` is a coroutine function)."""

    sync_capable = True
    async_capable = True
    _async = False

    def _adopt(self, get_response: Callable[[HttpRequest], Any] | None) -> None:
        self._async = iscoroutinefunction(get_response)
        if self._async:
            markcoroutinefunction(self)


class AsyncWhiteNoiseMiddleware(AsyncCapable, WhiteNoiseMiddleware):
    def __init__(self, get_response: Callable[[HttpRequest], Any] | None = None, **kwargs: Any) -> None:
        super().__init__(get_response, **kwargs)
        self._adopt(get_response)

    def __call__(self, request: HttpRequest) -> HttpResponseBase | Awaitable[HttpResponseBase]:
        if self._async:
            return self._acall(request)
        return super().__call__(request)

    async def _acall(self, request: HttpRequest) -> HttpResponseBase:
        static_file = self.find_file(request.path_info) if self.autorefresh else self.files.get(request.path_info)
        if static_file is not None:
            return self.serve(static_file, request)
        return await self.get_response(request)


class RequestIdMiddleware(AsyncCapable):
    """Every response carries `x-request-id` (quote it to support), the client's own
    `X-Client-Request-Id` echoed back, and `openai-processing-ms` (the gateway's time to
    the response's headers), as OpenAI's API does. Async-capable: no thread hop."""

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        self._adopt(get_response)

    def __call__(self, request: HttpRequest) -> HttpResponseBase | Awaitable[HttpResponseBase]:
        if self._async:
            return self._acall(request)
        started = time.perf_counter()
        return self._stamp(request, self.get_response(request), started)

    async def _acall(self, request: HttpRequest) -> HttpResponseBase:
        started = time.perf_counter()
        return self._stamp(request, await self.get_response(request), started)

    @staticmethod
    def _stamp(request: HttpRequest, response: HttpResponseBase, started: float) -> HttpResponseBase:
        response["x-request-id"] = f"req_{uuid.uuid4().hex}"
        client = request.headers.get("X-Client-Request-Id", "")
        if client and len(client) <= 512 and client.isprintable():
            response["x-client-request-id"] = client
        response["openai-processing-ms"] = str(round((time.perf_counter() - started) * 1000))
        return response


def client_ip(request: HttpRequest) -> str:
    """The customer's address for rate limits: REMOTE_ADDR, or behind TRUSTED_PROXY_COUNT
    proxies (HAProxy, a TLS proxy) the address the outermost trusted one saw, from the
    right of X-Forwarded-For (entries to its left are the client's own word)."""
    from django.conf import settings

    hops = settings.AXES_IPWARE_PROXY_COUNT
    forwarded = [part.strip() for part in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",") if part.strip()]
    if hops and len(forwarded) >= hops:
        return forwarded[-hops]
    return request.META.get("REMOTE_ADDR", "") or "unknown"
