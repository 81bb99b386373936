"""The host WebSocket refuses what the HTTP API refuses, on a real gateway: an inactive
owner's host cannot open one, and a claim on one already open is refused from the moment
the owner is deactivated."""

from __future__ import annotations

import json

import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from conftest import make_host
from mahout.presence import presence_url
from testkit.personas import present

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e]


def host_socket(gateway, token: str):  # type: ignore[no-untyped-def]
    return connect(presence_url(gateway.url), additional_headers={"Authorization": f"Bearer {token}"}, open_timeout=10)


def set_active(user, active: bool) -> None:  # type: ignore[no-untyped-def]
    user.is_active = active
    user.save(update_fields=["is_active"])


class InactiveOwnerSocketTests:
    def test_an_inactive_owners_host_cannot_open_its_socket_until_reactivated(self, gateway, catalog) -> None:
        serving = make_host(name="lapsed")
        set_active(serving.host.owner, False)
        with pytest.raises(InvalidStatus) as refused:
            host_socket(gateway, serving.token)
        assert refused.value.response.status_code == 403
        set_active(serving.host.owner, True)
        with host_socket(gateway, serving.token) as socket:
            socket.send(json.dumps({"type": "ping"}))
            assert json.loads(socket.recv(timeout=10)) == {"type": "pong"}

    def test_a_claim_on_an_open_socket_is_refused_once_the_owner_is_deactivated(self, gateway, catalog) -> None:
        serving = present(make_host(name="closing"))
        with host_socket(gateway, serving.token) as socket:
            claim = {"type": "claim", "fingerprint": serving.fingerprint, "wait": 0}
            socket.send(json.dumps({**claim, "id": 1}))
            assert json.loads(socket.recv(timeout=10)) == {
                "type": "job",
                "id": 1,
                "job": None,
            }  # nothing queued, but allowed
            set_active(serving.host.owner, False)
            try:
                socket.send(json.dumps({**claim, "id": 2}))
                answer = json.loads(socket.recv(timeout=10))
            except ConnectionClosed as closed:  # with a shared channel layer (Redis) the deactivation closes it at once
                assert closed.rcvd is not None and closed.rcvd.code == 4403
                return
        # the test process's deactivation reaches the gateway's in-process layer only through the row:
        # the claim re-reads it
        assert (answer["type"], answer["id"], answer["status"], answer["code"]) == ("error", 2, 403, "owner_inactive")
