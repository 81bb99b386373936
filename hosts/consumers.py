"""The host presence socket: the fast path for noticing a dead host.

mahout keeps one outbound WebSocket open to `/hosts/ws` while it runs. A
killed process's sockets are closed by its operating system, so the gateway
sees the disconnect within a moment and declares the host's running attempts
dead (they are continued elsewhere) instead of waiting out the 20 s stall
rule. A frozen host keeps its socket open; the stall rule catches that one.
One mahout process per host token: a second connection's end would count as
the host's death.
"""
from __future__ import annotations

from channels.generic.websocket import AsyncJsonWebsocketConsumer

from hosts.apis import host_from_secret
from marketplace import services
from marketplace.aio import db
from marketplace.errors import ApiError


class HostPresenceConsumer(AsyncJsonWebsocketConsumer):
    host_id: int | None = None

    async def connect(self) -> None:
        headers = {name.decode().lower(): value.decode() for name, value in self.scope.get("headers", [])}
        scheme, _, token = headers.get("authorization", "").partition(" ")
        try:
            if scheme.lower() != "bearer" or not token.strip():
                raise ApiError(401, "missing host token", code="missing_host_token")
            host = await db(host_from_secret, token.strip())
        except ApiError:
            await self.close(code=4401)
            return
        self.host_id = host.pk
        await self.accept()

    async def receive_json(self, content: object, **kwargs: object) -> None:
        await self.send_json({"type": "pong"})

    async def disconnect(self, code: int) -> None:
        if self.host_id is not None:
            await db(services.host_connection_lost, host_id=self.host_id)
