"""WebSocket streaming: the same chunks as SSE, one JSON frame each.

Connect to /v1/ws/chat/completions with `Authorization: Bearer <key>` (or send
`"api_key"` in the message when the client cannot set headers — never in the
URL, where keys end up in logs), send one chat request body, and receive
chunk frames followed by {"done": true}, or one error frame.
"""
from __future__ import annotations

from channels.generic.websocket import AsyncJsonWebsocketConsumer

from marketplace.apis import admit_generation
from marketplace.errors import ApiError, bad_request
from marketplace.models import Request


class ChatStreamConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self) -> None:
        await self.accept()

    def _secret(self, content: dict) -> str:
        headers = {name.decode().lower(): value.decode() for name, value in self.scope.get("headers", [])}
        scheme, _, secret = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and secret.strip():
            return secret.strip()
        if isinstance(content.get("api_key"), str) and content["api_key"]:
            return content["api_key"]
        raise ApiError(401, "Missing API key: send 'Authorization: Bearer <key>' or \"api_key\" in the message.", code="missing_api_key", type="authentication_error")

    async def receive_json(self, content: object, **kwargs: object) -> None:
        try:
            if not isinstance(content, dict):
                raise bad_request("Send one JSON object: a chat completion request.", code="invalid_json")
            secret = self._secret(content)
            body = {k: v for k, v in content.items() if k != "api_key"}
            body["stream"] = True
            admitted = await admit_generation(secret=secret, body=body, kind=Request.Kind.CHAT)
        except ApiError as error:
            await self.send_json(error.body())
            await self.close()
            return
        async for chunk in admitted.chunks():
            await self.send_json({"done": True} if chunk == "[DONE]" else chunk)
        await self.close()

    async def decode_json(self, text_data: str) -> object:
        try:
            return await super().decode_json(text_data)
        except ValueError:
            return None
