"""WebSocket routes of the ring relay; `config.asgi` lists them in its URLRouter."""
from __future__ import annotations

from django.urls import path

from mesh.rings.consumers import RingRelayDialConsumer, RingRelayStageConsumer

websocket_urlpatterns = [
    path("api/rings/<int:ring_id>/relay/stage/<int:index>", RingRelayStageConsumer.as_asgi()),
    path("api/rings/<int:ring_id>/relay/dial/<int:index>", RingRelayDialConsumer.as_asgi()),
]
