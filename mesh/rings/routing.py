"""WebSocket routes of the ring relay; `config.asgi` lists them in its URLRouter."""

from __future__ import annotations

from django.urls import path

from mesh.rings.consumers import RingRelayDialConsumer, RingRelayStageConsumer

websocket_urlpatterns = [
    path("api/rings/<id:ring_id>/relay/stage/<id:index>", RingRelayStageConsumer.as_asgi()),
    path("api/rings/<id:ring_id>/relay/dial/<id:index>", RingRelayDialConsumer.as_asgi()),
]
