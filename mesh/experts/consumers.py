"""The expert relay: workers behind NAT connect outward to the gateway, and the coordinator
reaches them through it.

A worker holds `ws …/api/moe/relay/worker/<id>`; its coordinator opens
`ws …/api/moe/relay/coordinator/<id>`. Frames are opaque here (the `mahout.link`
bytes of a compute request or its result): a coordinator frame goes to the worker's group
with the coordinator's channel as the reply address; the worker answers its requests in
order, so each answer goes back to the oldest waiting reply address. If the worker's
socket closes, every coordinator still waiting is told at once (the coordinator then
computes those experts itself). Both ends authenticate with their host token; the relay
never interprets or stores a frame.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

from channels.generic.websocket import AsyncWebsocketConsumer

from core.db import db
from core.errors import DomainError
from core.http import scope_bearer
from hosts.selectors import host_from_secret
from mesh.experts import selectors

__all__ = ["ExpertRelayCoordinatorConsumer", "ExpertRelayWorkerConsumer", "relay_group"]

CLOSE_UNAUTHORIZED = 4401
CLOSE_FORBIDDEN = 4403
CLOSE_WORKER_GONE = 4410


def relay_group(worker_id: int) -> str:
    return f"moe-relay-{worker_id}"


class _RelayConsumer(AsyncWebsocketConsumer):
    worker_id: int = 0

    async def authenticated_host_id(self) -> int | None:
        token = scope_bearer(self.scope)
        if token is None:
            return None
        try:
            host = await db(host_from_secret, token)
        except DomainError:
            return None
        return host.pk

    async def admitted(self, allowed: Callable[..., bool]) -> bool:
        """Read the route's worker id and check the token and `allowed(worker_id=, host_id=)`;
        a refused socket is closed (4401 without a valid token, 4403 for another's worker)."""
        self.worker_id = int(self.scope["url_route"]["kwargs"]["worker_id"])
        host_id = await self.authenticated_host_id()
        if host_id is None:
            await self.close(code=CLOSE_UNAUTHORIZED)
            return False
        if not await db(allowed, worker_id=self.worker_id, host_id=host_id):
            await self.close(code=CLOSE_FORBIDDEN)
            return False
        return True


class ExpertRelayWorkerConsumer(_RelayConsumer):
    """The worker's end: requests in, answers out, in order."""

    async def connect(self) -> None:
        self.waiting: deque[str] = deque()
        if not await self.admitted(selectors.relay_worker_allowed):
            return
        await self.channel_layer.group_add(relay_group(self.worker_id), self.channel_name)
        await self.accept()

    async def relay_request(self, event: dict) -> None:
        self.waiting.append(event["reply_to"])
        await self.send(bytes_data=event["frame"])

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if bytes_data is not None and self.waiting:
            await self.channel_layer.send(self.waiting.popleft(), {"type": "relay.reply", "frame": bytes_data})

    async def disconnect(self, code: int) -> None:
        await self.channel_layer.group_discard(relay_group(self.worker_id), self.channel_name)
        for reply_to in getattr(self, "waiting", ()):
            await self.channel_layer.send(reply_to, {"type": "relay.gone"})


class ExpertRelayCoordinatorConsumer(_RelayConsumer):
    """The coordinator's end: its frames go to the worker, the worker's answers come back."""

    async def connect(self) -> None:
        if await self.admitted(selectors.relay_coordinator_allowed):
            await self.accept()

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if bytes_data is not None:
            await self.channel_layer.group_send(
                relay_group(self.worker_id), {"type": "relay.request", "reply_to": self.channel_name, "frame": bytes_data}
            )

    async def relay_reply(self, event: dict) -> None:
        await self.send(bytes_data=event["frame"])

    async def relay_gone(self, event: dict) -> None:
        await self.close(code=CLOSE_WORKER_GONE)
