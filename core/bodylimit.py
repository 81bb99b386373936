"""A bound on every HTTP body, enforced while it is read, before any view runs.

Django's ASGI handler reads the whole body (spooling it to disk past a size) before it
calls a view, and `Content-Length` may be absent (a chunked body): a limit checked in the
view comes after the work it should prevent. `BodyLimit` wraps the ASGI application: a
declared length over the limit is refused at once; a body that grows past it while it
arrives is cut off (the application sees the client disconnect, so Django answers
nothing) and refused. Either way the answer is a 413 in the API's error format, before
authentication or parsing.

What it cannot bound: daphne (Twisted) receives a request's whole body into a temporary
file before it calls the application at all. So the gateway runs daphne through
`config.gateway`, which refuses a body while it arrives; in front of several processes the
shipped HAProxy configuration also refuses a declared length over the limit at the edge
(`config.balancer`).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


def too_large(limit: int, *, declared: int | None = None) -> bytes:
    size = f" ({declared} bytes)" if declared is not None else ""
    return json.dumps(
        {
            "error": {
                "message": f"Request body too large{size}: the limit is {limit} bytes.",
                "type": "invalid_request_error",
                "param": None,
                "code": "body_too_large",
            }
        }
    ).encode()


class BodyLimit:
    def __init__(self, app: App, *, limit: Callable[[], int]) -> None:
        self.app, self.limit = app, limit  # `limit` is read per request (settings may change in tests)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit()
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                await self._refuse(
                    send,
                    400,
                    json.dumps(
                        {
                            "error": {
                                "message": "Content-Length is not a number.",
                                "type": "invalid_request_error",
                                "param": None,
                                "code": "invalid_request",
                            }
                        }
                    ).encode(),
                )
                return
            if int(declared) > limit:
                await self._refuse(send, 413, too_large(limit, declared=int(declared)))
                return
        received, over, started = 0, False, False

        async def bounded() -> Message:
            nonlocal received, over
            if over:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body") or b"")
                if received > limit:
                    over = True
                    return {"type": "http.disconnect"}  # the application stops reading and answers nothing
            return message

        async def watched(message: Message) -> None:
            nonlocal started
            if over and not started:
                return  # the refusal below is the answer
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, bounded, watched)
        if over and not started:
            await self._refuse(send, 413, too_large(limit))

    @staticmethod
    async def _refuse(send: Send, status: int, body: bytes) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
