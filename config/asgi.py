"""ASGI entry point: Django for HTTP (including SSE), Channels for WebSockets."""
from __future__ import annotations

import os

import django
from django.core.handlers.asgi import ASGIHandler

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django.setup(set_prefix=False)

from config.middleware import API_PATHS  # noqa: E402  (needs Django set up)


class GatewayHandler(ASGIHandler):
    """Django's ASGI handler, without a thread of its own for each API request.

    Django gives every request a fresh thread for its sync parts (`ThreadSensitiveContext`):
    the signals at its start and end and the response's close. Starting and joining that
    thread held the event loop on every API call (py-spy: about a sixth of a refused request's
    time on the loop), though an API request has no sync part of its own: its database work
    runs on `core.db`'s pool. API requests share asgiref's one long-lived sync thread for
    those signals instead; pages keep a thread each (their views are sync)."""

    async def __call__(self, scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] == "http" and scope["path"].startswith(API_PATHS):
            await self.handle(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


django_asgi = GatewayHandler()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402  (needs Django set up)
from django.conf import settings  # noqa: E402
from django.urls import path  # noqa: E402

from core.bodylimit import BodyLimit  # noqa: E402
from marketplace.consumers import ChatStreamConsumer, HostSocketConsumer  # noqa: E402
from mesh.experts.routing import websocket_urlpatterns as moe_relay_routes  # noqa: E402
from mesh.rings.routing import websocket_urlpatterns as ring_relay_routes  # noqa: E402

application = ProtocolTypeRouter(
    {
        "http": BodyLimit(django_asgi, limit=lambda: settings.DATA_UPLOAD_MAX_MEMORY_SIZE),  # bounded while read
        "websocket": URLRouter(
            [
                path("v1/ws/chat/completions", ChatStreamConsumer.as_asgi()),
                path("hosts/ws", HostSocketConsumer.as_asgi()),
                *moe_relay_routes,  # expert workers behind NAT, reached through the gateway
                *ring_relay_routes,  # ring stages behind NAT, likewise
            ]
        ),
    }
)
