"""ASGI entry point: Django for HTTP (including SSE), Channels for WebSockets."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import django
from asgiref.sync import iscoroutinefunction, sync_to_async
from django.core.handlers.asgi import ASGIHandler
from django.http import HttpRequest, HttpResponseBase

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django.setup(set_prefix=False)

from config.middleware import API_PATHS  # noqa: E402  (needs Django set up)
from core.db import db  # noqa: E402


class GatewayHandler(ASGIHandler):
    """Django's ASGI handler, without a thread of its own for each API request.

    Django gives every request a fresh thread for its sync parts (`ThreadSensitiveContext`):
    the signals at its start and end and the response's close. Starting and joining that
    thread held the event loop on every API call (py-spy: about a sixth of a refused request's
    time on the loop). API requests share asgiref's one long-lived sync thread for those
    signals instead; pages keep a thread each (their views are sync).

    That one thread must then carry nothing slow: an API view that is sync (a DRF view: the
    heartbeat, `me`, the schema) runs, and its response renders, on `core.db`'s pool
    (`make_view_atomic`), which tidies the thread's connection around it as for any other
    database work. Otherwise one slow call (a row lock, a large statement) would hold every
    other sync API call of the process behind it."""

    async def __call__(self, scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] == "http" and scope["path"].startswith(API_PATHS):
            await self.handle(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    def make_view_atomic(self, view: Callable[..., HttpResponseBase]) -> Callable[..., Any]:
        view = super().make_view_atomic(view)
        if iscoroutinefunction(view):
            return view
        by_thread = sync_to_async(view, thread_sensitive=True)
        # (such middleware must see the response before it renders; Django's private list, not in its stubs)
        render_here = not self._template_response_middleware  # type: ignore[attr-defined]

        async def pooled(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
            if not request.path.startswith(API_PATHS):
                return await by_thread(request, *args, **kwargs)  # a page: its own thread, as Django does
            if render_here:
                return await db(_rendered, view, request, *args, **kwargs)
            return await db(view, request, *args, **kwargs)

        return pooled


def _rendered(
    view: Callable[..., HttpResponseBase], request: HttpRequest, *args: Any, **kwargs: Any
) -> HttpResponseBase:
    """A sync API view's response, rendered where it was made (a DRF response renders lazily:
    Django would hop to the shared thread to render it)."""
    response = view(request, *args, **kwargs)
    render = getattr(response, "render", None)
    if callable(render):
        response = render()
    return response


django_asgi = GatewayHandler()

from channels.generic.websocket import AsyncWebsocketConsumer  # noqa: E402  (needs Django set up)
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.conf import settings  # noqa: E402
from django.urls import path, re_path  # noqa: E402

from core.bodylimit import BodyLimit  # noqa: E402
from marketplace.hostdoor.consumers import HostSocketConsumer  # noqa: E402
from marketplace.openai.consumers import ChatStreamConsumer  # noqa: E402
from mesh.experts.routing import websocket_urlpatterns as moe_relay_routes  # noqa: E402
from mesh.rings.routing import websocket_urlpatterns as ring_relay_routes  # noqa: E402


class NoRoute(AsyncWebsocketConsumer):
    """A socket to a path the gateway does not serve (or with an id past 64 bits, which names
    nothing: the routes' ids are `core.http.IdConverter`'s) is refused at its handshake (403),
    as a stranger's is, rather than failing in the router (a 500)."""

    async def connect(self) -> None:
        await self.close(code=4404)


application = ProtocolTypeRouter(
    {
        "http": BodyLimit(django_asgi, limit=lambda: settings.DATA_UPLOAD_MAX_MEMORY_SIZE),  # bounded while read
        "websocket": URLRouter(
            [
                path("v1/ws/chat/completions", ChatStreamConsumer.as_asgi()),
                path("hosts/ws", HostSocketConsumer.as_asgi()),
                *moe_relay_routes,  # expert workers behind NAT, reached through the gateway
                *ring_relay_routes,  # ring stages behind NAT, likewise
                re_path(r"", NoRoute.as_asgi()),  # last: any other path (an id past `core.http.IdConverter`'s too)
            ]
        ),
    }
)
