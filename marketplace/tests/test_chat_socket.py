"""The chat WebSocket authenticates before it accepts (issue 17): no key or a bad key is
refused at the handshake; a browser's key rides in a subprotocol; messages are bounded and
one request is served per connection. On the real ASGI server."""

from __future__ import annotations

import asyncio
import json

import pytest
import websockets
from websockets.exceptions import InvalidStatus

from conftest import make_customer

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def url(gateway) -> str:  # noqa: ANN001
    return gateway.url.replace("http", "ws") + "/v1/ws/chat/completions"


def handshake_status(gateway, **options) -> int:  # noqa: ANN001, ANN003
    async def attempt() -> int:
        try:
            async with websockets.connect(url(gateway), **options):
                return 101
        except InvalidStatus as refused:
            return refused.response.status_code

    return asyncio.run(attempt())


def exchange(gateway, frames: list[str], **options) -> list[dict]:  # noqa: ANN001, ANN003
    async def talk() -> list[dict]:
        async with websockets.connect(url(gateway), **options) as ws:
            for frame in frames:
                await ws.send(frame)
            return [json.loads(answer) async for answer in ws]

    return asyncio.run(talk())


class ChatSocketAuthTests:
    def test_no_key_or_a_bad_key_is_refused_at_the_handshake(self, gateway, catalog) -> None:
        assert handshake_status(gateway) == 403
        assert handshake_status(gateway, additional_headers={"Authorization": "Bearer el-nope"}) == 403
        assert handshake_status(gateway, subprotocols=["elephant-key.el-nope"]) == 403

    def test_a_browser_sends_its_key_as_a_subprotocol(self, gateway, catalog) -> None:
        customer = make_customer()
        answers = exchange(
            gateway,
            [json.dumps({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]})],
            subprotocols=[f"elephant-key.{customer.secret}"],
        )
        assert answers == [{"error": {**answers[0]["error"], "code": "model_not_found"}}], (
            "authenticated: the body was read"
        )

    def test_a_non_finite_number_is_refused(self, gateway, catalog) -> None:
        customer = make_customer()
        headers = {"Authorization": f"Bearer {customer.secret}"}
        nan = '{"model": "gemma-3-270m", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'
        assert exchange(gateway, [nan], additional_headers=headers)[0]["error"]["code"] == "invalid_json"

    def test_a_message_over_the_limit_is_refused(self, gateway, catalog, settings) -> None:
        customer = make_customer()
        over = settings.DATA_UPLOAD_MAX_MEMORY_SIZE + 20_000  # past the gateway's limit, under daphne's 1 MiB frame cap
        big = json.dumps({"model": "gemma-3-270m", "messages": [{"role": "user", "content": "x" * over}]})

        async def talk() -> object:
            async with websockets.connect(
                url(gateway), additional_headers={"Authorization": f"Bearer {customer.secret}"}, max_size=None
            ) as ws:
                await ws.send(big)
                try:
                    return json.loads(await ws.recv())
                except websockets.ConnectionClosed as closed:
                    return closed.rcvd.code if closed.rcvd else None

        answer = asyncio.run(talk())
        assert isinstance(answer, dict) and answer["error"]["code"] == "body_too_large", answer
