"""The gateway's own middleware: WhiteNoise made async-capable, request ids, and Django's
own middleware kept off the API's paths or run without a thread hop.

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
from typing import Any, cast

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.contrib.auth.middleware import AuthenticationMiddleware
from django.contrib.messages.middleware import MessageMiddleware
from django.contrib.sessions.middleware import SessionMiddleware
from django.http import HttpRequest, HttpResponseBase
from django.middleware.clickjacking import XFrameOptionsMiddleware
from django.middleware.common import CommonMiddleware
from django.middleware.csrf import CsrfViewMiddleware
from django.middleware.security import SecurityMiddleware
from whitenoise.middleware import WhiteNoiseMiddleware

# The API's paths: a key or a host token authenticates them, and they render no page.
API_PATHS = ("/v1/", "/hosts/api/", "/api/", "/billing/api/", "/healthz")  # not /metrics: staff may sign in to read it


class AsyncCapable:
    """Django's async-capable middleware contract in one place: serve the async chain
    without a thread hop (`_async`: whether `get_response` is a coroutine function)."""

    sync_capable = True
    async_capable = True
    _async = False

    def _adopt(self, get_response: Callable[[HttpRequest], Any] | None) -> None:
        self._async = iscoroutinefunction(get_response)
        if self._async:
            markcoroutinefunction(cast(Callable[..., Any], self))  # (the middleware classes are the callables)


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


# Django's own middleware, in an async gateway.
#
# Django runs a sync middleware's hooks through `sync_to_async(thread_sensitive=True)`: one
# shared thread, one hop per hook. Its seven stock middleware made 13 hops on every request,
# an API call's included, and each hop costs the event loop (py-spy: about 12 ms of it per
# refused request; twenty refusals at once held every stream on the process for 100+ ms).
# Two remedies, each a subclass so that Django's checks still find the middleware they need:
# - `Inline`: hooks that only compute (headers, redirects) run in the event loop itself;
# - `PagesOnly`: what only pages need (sessions, CSRF, sign-in, messages) is skipped on the
#   API's paths. The API authenticates by key or host token and its views are CSRF-exempt.


class Inline:
    """A middleware whose `process_request`/`process_response` do no I/O, run without a hop."""

    get_response: Callable[[HttpRequest], HttpResponseBase | Awaitable[HttpResponseBase]]

    async def __acall__(self, request: HttpRequest) -> HttpResponseBase:
        before = getattr(self, "process_request", None)
        response = before(request) if before else None
        # (Django calls __acall__ only on the async chain, where get_response is a coroutine function)
        response = response or await cast(Awaitable[HttpResponseBase], self.get_response(request))
        after = getattr(self, "process_response", None)
        return after(request, response) if after else response


class PagesOnly:
    """A middleware that the API's paths go past (no hop, no session, no CSRF check)."""

    get_response: Callable[[HttpRequest], Any]
    process_view: Callable[..., Any]  # the middleware's own, where it has one

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        super().__init__(get_response)  # type: ignore[call-arg]
        if iscoroutinefunction(get_response) and hasattr(self, "process_view"):
            self.process_view = self._process_view_async  # Django would hop for a sync one

    def __call__(self, request: HttpRequest) -> Any:
        if request.path.startswith(API_PATHS):
            return self.get_response(request)
        return super().__call__(request)  # type: ignore[misc]

    async def _process_view_async(self, request: HttpRequest, *view: Any) -> HttpResponseBase | None:
        if request.path.startswith(API_PATHS):
            return None
        return await sync_to_async(type(self).process_view, thread_sensitive=True)(self, request, *view)


class Security(Inline, SecurityMiddleware):
    pass


class Common(Inline, CommonMiddleware):
    pass


class XFrameOptions(Inline, XFrameOptionsMiddleware):
    pass


class Sessions(PagesOnly, SessionMiddleware):
    pass


class Csrf(PagesOnly, CsrfViewMiddleware):
    pass


class Authentication(PagesOnly, AuthenticationMiddleware):
    pass


class Messages(PagesOnly, MessageMiddleware):
    pass
