"""The customer's WebSocket: chat streams, the same chunks as SSE, one JSON frame each.

Connect to /v1/ws/chat/completions with `Authorization: Bearer <key>`, or, from a
browser (which cannot set headers), with the subprotocol `elephant-key.<key>` — never
in the URL, where keys end up in logs. The key is checked before the connection is
accepted: a missing or invalid one is refused at the handshake (HTTP 403). Then send
one chat request body (at most MAX_BODY_BYTES) and receive chunk frames followed by
{"done": true}, or one error frame.
"""

from __future__ import annotations

from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings

from accounts.selectors import api_key_by_secret
from core.db import db
from core.errors import ApiError, DomainError, bad_request
from core.http import scope_bearer
from core.parsers import json_loads
from marketplace.models import Request
from marketplace.openai.choices import admit_choices, stream_chunks

KEY_SUBPROTOCOL = "elephant-key."


class ChatStreamConsumer(AsyncJsonWebsocketConsumer):
    secret: str = ""
    answered = False  # one request per connection

    async def connect(self) -> None:
        """Authenticate before accepting: a stranger gets no open socket to write to."""
        offered = [p for p in self.scope.get("subprotocols") or [] if p.startswith(KEY_SUBPROTOCOL)]
        secret = scope_bearer(self.scope) or (offered[0].removeprefix(KEY_SUBPROTOCOL) if offered else None)
        if not secret or await db(api_key_by_secret, secret=secret) is None:
            await self.close()  # before accept: the handshake is refused (HTTP 403)
            return
        self.secret = secret
        await self.accept(subprotocol=offered[0] if offered else None)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None, **kwargs: object) -> None:
        size = len(text_data.encode()) if text_data is not None else len(bytes_data or b"")
        if size > settings.DATA_UPLOAD_MAX_MEMORY_SIZE or self.answered:
            why = (
                f"The message is too large ({size} bytes; the limit is {settings.DATA_UPLOAD_MAX_MEMORY_SIZE})."
                if not self.answered
                else "One request per connection: open another for the next one."
            )
            await self.send_json(
                ApiError(
                    413 if not self.answered else 400,
                    why,
                    code="body_too_large" if not self.answered else "invalid_request",
                ).body()
            )
            await self.close()
            return
        await super().receive(text_data=text_data, bytes_data=bytes_data, **kwargs)

    async def receive_json(self, content: object, **kwargs: object) -> None:
        self.answered = True
        try:
            if not isinstance(content, dict):
                raise bad_request("Send one JSON object: a chat completion request.", code="invalid_json")
            body = {**content, "stream": True}
            choices = await admit_choices(secret=self.secret, body=body, kind=Request.Kind.CHAT)
        except DomainError as error:
            await self.send_json(error.body())
            await self.close()
            return
        async for chunk in stream_chunks(choices):
            await self.send_json({"done": True} if chunk == "[DONE]" else chunk)
        await self.close()

    async def decode_json(self, text_data: str) -> object:
        try:
            return json_loads(text_data)
        except ValueError:  # not JSON, NaN / Infinity, or nested too deep: refused as "not one JSON object"
            return None
