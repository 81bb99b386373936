"""The gateway's byte relay: a host behind NAT holds one WebSocket open as a *listener*, and
each peer allowed to reach it *dials* with a WebSocket of its own; the relay moves the bytes
of each such connection both ways, as TCP would (`mahout.relay` is the hosts' side).

The listener's socket carries every connection dialled to it: ``{"open": n}`` (text), its
bytes as binary messages prefixed by ``>I`` n, its end as ``{"close": n}``; the listener
sends the same back. A dial socket is one connection, its binary messages the raw bytes.
What runs over a connection is a `mahout.link`: its handshake and sealing run end to end
between the hosts, so the relay never interprets or stores a byte and sees only the
handshake and ciphertext. Both ends authenticate with their host tokens; each relay says who
may listen and who may dial (`allowed`), and a listener that opens its socket again replaces
its older one (a restarted host).

The ring relay (`mesh.rings.consumers`) and the expert relay (`mesh.experts.consumers`)
subclass `ListenerConsumer` and `DialConsumer`.
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

__all__ = [
    "CLOSE_FORBIDDEN",
    "CLOSE_GONE",
    "CLOSE_REPLACED",
    "CLOSE_TOO_EARLY",
    "CLOSE_UNAUTHORIZED",
    "DialConsumer",
    "ListenerConsumer",
    "RelayConsumer",
]

CLOSE_UNAUTHORIZED = 4401
CLOSE_FORBIDDEN = 4403
CLOSE_GONE = 4410  # the listener's end of this connection closed
CLOSE_REPLACED = 4409  # the listener opened a newer relay socket
CLOSE_TOO_EARLY = 4413  # a dialler sent more than EARLY_MAX_BYTES before the listener's end answered
CONN = struct.Struct(">I")
EARLY_MAX_BYTES = 1 << 20  # what a dialler may send before the listener answers (the link's listener speaks first)


class RelayConsumer(AsyncWebsocketConsumer):
    """One end of a relayed connection. A subclass names the route's ids (`route`), the
    group of the listener they address (`group`) and who may open this end (`allowed`)."""

    allowed: Callable[..., bool]  # a staticmethod: (**route, host_id=) -> bool, run in a thread (it reads the database)
    ids: dict[str, int]

    def route(self, kwargs: dict[str, str]) -> dict[str, int]:
        raise NotImplementedError

    def group(self) -> str:
        raise NotImplementedError

    async def admitted(self) -> bool:
        """Read the route and check the token and `allowed`; a refused socket is closed (4401
        without a valid token, 4403 when not allowed)."""
        self.ids = self.route(self.scope["url_route"]["kwargs"])
        token = scope_bearer(self.scope)
        try:
            host = await db(host_from_secret, token) if token is not None else None
        except DomainError:
            host = None
        if host is None:
            await self.close(code=CLOSE_UNAUTHORIZED)
            return False
        if not await db(self.allowed, **self.ids, host_id=host.pk):
            await self.close(code=CLOSE_FORBIDDEN)
            return False
        return True


class ListenerConsumer(RelayConsumer):
    """The listener's end: every connection dialled to it, multiplexed by number."""

    async def connect(self) -> None:
        self.dialers: dict[int, str] = {}  # connection number -> the dialer's channel
        self.opened = 0
        if not await self.admitted():
            return
        await self.channel_layer.group_send(
            self.group(), {"type": "relay.replaced"}
        )  # an older socket of this listener
        await self.channel_layer.group_add(self.group(), self.channel_name)
        await self.accept()

    async def relay_replaced(self, event: dict) -> None:
        await self.close(code=CLOSE_REPLACED)

    async def relay_open(self, event: dict) -> None:
        self.opened += 1
        self.dialers[self.opened] = event["reply_to"]
        await self.channel_layer.send(
            event["reply_to"], {"type": "relay.opened", "listener": self.channel_name, "conn": self.opened}
        )
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
                await self.channel_layer.send(dialer, {"type": "relay.bytes", "data": bytes_data[CONN.size :]})
        elif text_data is not None:
            await self._closed_by_listener(text_data)

    async def _closed_by_listener(self, text_data: str) -> None:
        try:
            conn = int(json.loads(text_data)["close"])
        except (ValueError, KeyError, TypeError):
            return  # nothing else is said on this socket
        dialer = self.dialers.pop(conn, None)
        if dialer is not None:
            await self.channel_layer.send(dialer, {"type": "relay.gone"})

    async def disconnect(self, code: int) -> None:
        if hasattr(self, "ids"):
            await self.channel_layer.group_discard(self.group(), self.channel_name)
        for dialer in getattr(self, "dialers", {}).values():
            await self.channel_layer.send(dialer, {"type": "relay.gone"})


class DialConsumer(RelayConsumer):
    """One connection to a listener: bytes in both directions until either end closes."""

    async def connect(self) -> None:
        self.listener: str | None = None
        self.conn = 0
        self.early: list[bytes] = []  # sent before the listener's end answered
        if not await self.admitted():
            return
        await self.accept()
        await self.channel_layer.group_send(self.group(), {"type": "relay.open", "reply_to": self.channel_name})

    async def relay_opened(self, event: dict) -> None:
        if self.listener is not None:
            return  # a second listener socket answered (one being replaced): the first one holds it
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
