"""ASGI entry point: Django for HTTP (including SSE), Channels for WebSockets."""
from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django_asgi = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402  (needs Django set up)
from django.conf import settings  # noqa: E402
from django.urls import path  # noqa: E402

from core.bodylimit import BodyLimit  # noqa: E402
from marketplace.consumers import ChatStreamConsumer, HostSocketConsumer  # noqa: E402
from mesh.experts.routing import websocket_urlpatterns as moe_relay_routes  # noqa: E402

application = ProtocolTypeRouter(
    {
        "http": BodyLimit(django_asgi, limit=lambda: settings.DATA_UPLOAD_MAX_MEMORY_SIZE),  # bounded while read
        "websocket": URLRouter(
            [
                path("v1/ws/chat/completions", ChatStreamConsumer.as_asgi()),
                path("hosts/ws", HostSocketConsumer.as_asgi()),
                *moe_relay_routes,  # expert workers behind NAT, reached through the gateway
            ]
        ),
    }
)
