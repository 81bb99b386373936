"""The gateway's WebSocket routes: an id past what a row's id can be names nothing, and a path
that names nothing is refused at the handshake, never a failure inside the router (a 500)."""

from __future__ import annotations

import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator

from conftest import make_host

pytestmark = pytest.mark.django_db(transaction=True)  # the relays' checks run on core.db's threads

TOO_BIG = "9" * 20  # past 64 bits


async def handshake(path: str, token: str) -> tuple[bool, int | None]:
    from config.asgi import application

    socket = WebsocketCommunicator(application, path, headers=[(b"authorization", f"Bearer {token}".encode())])
    connected, code = await socket.connect(timeout=10)
    if connected:
        await socket.disconnect()
    return connected, code


@pytest.mark.parametrize(
    "path",
    [
        f"/api/rings/{TOO_BIG}/relay/stage/0",
        f"/api/rings/1/relay/dial/{TOO_BIG}",
        f"/api/moe/relay/worker/{TOO_BIG}",
        f"/api/moe/relay/coordinator/{TOO_BIG}",
        "/api/rings/1/relay/nowhere",
        "/nothing/here",
    ],
)
def test_an_id_past_64_bits_or_an_unknown_path_is_refused_at_the_handshake(catalog, path: str) -> None:
    host = make_host(name="dialer")
    assert async_to_sync(handshake)(path, host.token) == (False, 4404)


def test_an_id_within_the_bounds_still_reaches_its_relay(catalog) -> None:
    """(which refuses it as its own rules say: this host runs no stage of that ring)"""
    host = make_host(name="dialer")
    assert async_to_sync(handshake)(f"/api/rings/{10**18 - 1}/relay/stage/0", host.token) == (False, 4403)
