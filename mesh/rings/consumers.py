"""The ring relay: stages behind NAT hold a socket open to the gateway, and their neighbours
and the bridge reach them through it, as they would dial them directly.

A stage that reported the relay address (`protocol.ring.RELAY_ADDRESS`) holds
`ws …/api/rings/<ring>/relay/stage/<index>`: every connection dialled to it arrives there as
``{"open": n}`` (text), its bytes as binary messages prefixed by ``>I`` n, and its end as
``{"close": n}``; the stage sends the same back. A participant dials with
`ws …/api/rings/<ring>/relay/dial/<index>`: one socket is one connection, its binary
messages the raw bytes. Both ends authenticate with their host tokens (the stage must run
that stage of an active ring, the dialer take part in it); the link handshake and its
sealing run end to end through the relay, which never interprets or stores a byte. A stage
that opens its relay socket again replaces its older one (a restarted stage).
"""
from __future__ import annotations

import json
import struct
from collections.abc import Callable

from channels.generic.websocket import AsyncWebsocketConsumer

from core.db import db
from core.errors import DomainError
from core.http import scope_bearer
from hosts.selectors import host_from_secret
from mesh.rings import selectors

__all__ = ["RingRelayDialConsumer", "RingRelayStageConsumer", "ring_relay_group"]

CLOSE_UNAUTHORIZED = 4401
CLOSE_FORBIDDEN = 4403
CLOSE_GONE = 4410  # the stage's end of this connection closed
CLOSE_REPLACED = 4409  # the stage opened a newer relay socket
CLOSE_TOO_EARLY = 4413  # a dialler sent more than EARLY_MAX_BYTES before the stage's end answered
CONN = struct.Struct(">I")
EARLY_MAX_BYTES = 1 << 20  # what a dialler may send before the stage answers (the link's listener speaks first)


def ring_relay_group(plan_id: int, index: int) -> str:
    return f"ring-relay-{plan_id}-{index}"


class _RingRelayConsumer(AsyncWebsocketConsumer):
    plan_id: int = 0
    index: int = 0

    async def admitted(self, allowed: Callable[..., bool]) -> bool:
        """Read the route and check the token and `allowed(plan_id=, index=, host_id=)`; a
        refused socket is closed (4401 without a valid token, 4403 when not allowed)."""
        kwargs = self.scope["url_route"]["kwargs"]
        self.plan_id, self.index = int(kwargs["ring_id"]), int(kwargs["index"])
        token = scope_bearer(self.scope)
        try:
            host = await db(host_from_secret, token) if token is not None else None
        except DomainError:
            host = None
        if host is None:
            await self.close(code=CLOSE_UNAUTHORIZED)
            return False
        if not await db(allowed, plan_id=self.plan_id, index=self.index, host_id=host.pk):
            await self.close(code=CLOSE_FORBIDDEN)
            return False
        return True


class RingRelayStageConsumer(_RingRelayConsumer):
    """The stage's end: every connection dialled to it, multiplexed by number."""

    async def connect(self) -> None:
        self.dialers: dict[int, str] = {}  # connection number -> the dialer's channel
        self.opened = 0
        if not await self.admitted(selectors.relay_stage_allowed):
            return
        group = ring_relay_group(self.plan_id, self.index)
        await self.channel_layer.group_send(group, {"type": "relay.replaced"})  # an older socket of this stage
        await self.channel_layer.group_add(group, self.channel_name)
        await self.accept()

    async def relay_replaced(self, event: dict) -> None:
        await self.close(code=CLOSE_REPLACED)

    async def relay_open(self, event: dict) -> None:
        self.opened += 1
        self.dialers[self.opened] = event["reply_to"]
        await self.channel_layer.send(event["reply_to"], {"type": "relay.opened", "listener": self.channel_name,
                                                          "conn": self.opened})
        await self.send(text_data=json.dumps({"open": self.opened}))

    async def relay_bytes(self, event: dict) -> None:
        if event["conn"] in self.dialers:
            await self.send(bytes_data=CONN.pack(event["conn"]) + event["data"])

    async def relay_closed(self, event: dict) -> None:
        if self.dialers.pop(event["conn"], None) is not None:
            await self.send(text_data=json.dumps({"close": event["conn"]}))

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if bytes_data is not None and len(bytes_data) >= CONN.size:
            (conn,) = CONN.unpack_from(bytes_data)
            dialer = self.dialers.get(conn)
            if dialer is not None:
                await self.channel_layer.send(dialer, {"type": "relay.bytes", "data": bytes_data[CONN.size:]})
        elif text_data is not None:
            await self._closed_by_stage(text_data)

    async def _closed_by_stage(self, text_data: str) -> None:
        try:
            conn = int(json.loads(text_data)["close"])
        except (ValueError, KeyError, TypeError):
            return  # nothing else is said on this socket
        dialer = self.dialers.pop(conn, None)
        if dialer is not None:
            await self.channel_layer.send(dialer, {"type": "relay.gone"})

    async def disconnect(self, code: int) -> None:
        await self.channel_layer.group_discard(ring_relay_group(self.plan_id, self.index), self.channel_name)
        for dialer in getattr(self, "dialers", {}).values():
            await self.channel_layer.send(dialer, {"type": "relay.gone"})


class RingRelayDialConsumer(_RingRelayConsumer):
    """One connection to a stage: bytes in both directions until either end closes."""

    async def connect(self) -> None:
        self.listener: str | None = None
        self.conn = 0
        self.early: list[bytes] = []  # sent before the stage's end answered
        if not await self.admitted(selectors.relay_dial_allowed):
            return
        await self.accept()
        await self.channel_layer.group_send(ring_relay_group(self.plan_id, self.index),
                                            {"type": "relay.open", "reply_to": self.channel_name})

    async def relay_opened(self, event: dict) -> None:
        if self.listener is not None:
            return  # a second stage socket answered (one being replaced): the first one holds it
        self.listener, self.conn = event["listener"], event["conn"]
        for data in self.early:
            await self._forward(data)
        self.early.clear()

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if bytes_data is None:
            return
        if self.listener is None:
            self.early.append(bytes_data)
            if sum(map(len, self.early)) > EARLY_MAX_BYTES:
                await self.close(code=CLOSE_TOO_EARLY)
        else:
            await self._forward(bytes_data)

    async def _forward(self, data: bytes) -> None:
        assert self.listener is not None
        await self.channel_layer.send(self.listener, {"type": "relay.bytes", "conn": self.conn, "data": data})

    async def relay_bytes(self, event: dict) -> None:
        await self.send(bytes_data=event["data"])

    async def relay_gone(self, event: dict) -> None:
        await self.close(code=CLOSE_GONE)

    async def disconnect(self, code: int) -> None:
        if getattr(self, "listener", None) is not None:
            await self.channel_layer.send(self.listener, {"type": "relay.closed", "conn": self.conn})
