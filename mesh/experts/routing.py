"""WebSocket routes of the expert relay; `config.asgi` lists them in its URLRouter."""

from __future__ import annotations

from django.urls import path

from mesh.experts.consumers import ExpertRelayCoordinatorConsumer, ExpertRelayWorkerConsumer

websocket_urlpatterns = [
    path("api/moe/relay/worker/<id:worker_id>", ExpertRelayWorkerConsumer.as_asgi()),
    path("api/moe/relay/coordinator/<id:worker_id>", ExpertRelayCoordinatorConsumer.as_asgi()),
]
