"""Revoking a host's token on a real gateway: its owner rotates it on My machines, an
operator bans the host in the admin. A socket open with the old token is closed at once
(4401 after a rotation, 4403 after a ban) and the old token's HTTP calls answer 401."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator

import httpx
import pytest
from django.contrib.auth import get_user_model
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from conftest import make_host
from mahout.presence import presence_url

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e]

PASSWORD = "a long enough password"


@contextlib.contextmanager
def signed_in(gateway, username: str, *, login: str = "/login/") -> Iterator[httpx.Client]:  # type: ignore[no-untyped-def]
    """A browser-like session on the gateway: the login form, posted with its CSRF token."""
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        http.get(login).raise_for_status()
        response = http.post(
            login, data={"username": username, "password": PASSWORD, "csrfmiddlewaretoken": http.cookies["csrftoken"]}
        )
        assert response.status_code == 302, response.text
        yield http


@contextlib.contextmanager
def open_socket(gateway, token: str) -> Iterator[ClientConnection]:  # type: ignore[no-untyped-def]
    """The host's WebSocket, answered once (so it is open and authenticated)."""
    with connect(
        presence_url(gateway.url), additional_headers={"Authorization": f"Bearer {token}"}, open_timeout=10
    ) as socket:
        socket.send(json.dumps({"type": "ping"}))
        assert json.loads(socket.recv(timeout=10)) == {"type": "pong"}
        yield socket


def close_code(socket: ClientConnection) -> int:
    """Read until the gateway closes the socket (TimeoutError if it does not); its close code."""
    with pytest.raises(ConnectionClosed) as closed:
        while True:
            socket.recv(timeout=10)
    assert closed.value.rcvd is not None
    return closed.value.rcvd.code


def heartbeat(gateway, token: str, fingerprint: str) -> int:
    return httpx.post(
        f"{gateway.url}/hosts/api/heartbeat",
        json={"fingerprint": fingerprint},
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    ).status_code


def refused_status(gateway, token: str) -> int:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidStatus) as refused, open_socket(gateway, token):
        pass
    return refused.value.response.status_code


class TokenRevocationTests:
    def test_rotating_on_my_machines_closes_the_old_tokens_socket_and_the_new_token_works(
        self, gateway, catalog
    ) -> None:
        serving = make_host(name="den")
        owner = serving.host.owner
        owner.set_password(PASSWORD)
        owner.save()
        with open_socket(gateway, serving.token) as socket, signed_in(gateway, owner.username) as http:
            page = http.post(
                f"/machines/{serving.host.pk}/token/", data={"csrfmiddlewaretoken": http.cookies["csrftoken"]}
            )
            assert page.status_code == 200 and "“den” has a new token" in page.text
            assert close_code(socket) == 4401
        token = re.search(r'id="host-token" class="wrap"><code>(host-[\w-]+)</code>', page.text).group(1)
        assert heartbeat(gateway, serving.token, serving.fingerprint) == 401
        assert heartbeat(gateway, token, serving.fingerprint) == 200
        assert refused_status(gateway, serving.token) == 403  # a refused handshake is a 403 whatever the reason
        with open_socket(gateway, token):
            pass

    def test_a_ban_in_the_admin_closes_the_hosts_socket_and_its_owner_reads_why(self, gateway, catalog) -> None:
        serving = make_host(name="rented")
        owner = serving.host.owner
        owner.set_password(PASSWORD)
        owner.save()
        operator = get_user_model().objects.create_superuser("ops-e2e", "ops@example.com", PASSWORD)
        with (
            open_socket(gateway, serving.token) as socket,
            signed_in(gateway, operator.username, login="/admin/login/") as http,
        ):
            done = http.post(
                "/admin/hosts/host/",
                data={
                    "action": "ban",
                    "_selected_action": [serving.host.pk],
                    "reason": "Resold customer prompts",
                    "apply": "Ban",
                    "csrfmiddlewaretoken": http.cookies["csrftoken"],
                },
            )
            assert done.status_code == 302, done.text
            assert close_code(socket) == 4403
        assert heartbeat(gateway, serving.token, serving.fingerprint) == 401
        with signed_in(gateway, owner.username) as http:
            page = http.get("/machines/").text
        assert "Banned by the operator: <span data-ban-reason>Resold customer prompts</span>" in page

    def test_deactivating_an_owner_in_the_admin_closes_its_hosts_sockets(self, gateway, catalog) -> None:
        serving = make_host(name="owned")
        owner = serving.host.owner
        operator = get_user_model().objects.create_superuser("ops-deactivate", "ops2@example.com", PASSWORD)
        with (
            open_socket(gateway, serving.token) as socket,
            signed_in(gateway, operator.username, login="/admin/login/") as http,
        ):
            joined = owner.date_joined
            done = http.post(
                f"/admin/auth/user/{owner.pk}/change/",
                data={  # the change form with "active" unticked
                    "username": owner.username,
                    "email": owner.email,
                    "first_name": "",
                    "last_name": "",
                    "date_joined_0": joined.strftime("%Y-%m-%d"),
                    "date_joined_1": joined.strftime("%H:%M:%S"),
                    "initial-date_joined_0": joined.strftime("%Y-%m-%d"),
                    "initial-date_joined_1": joined.strftime("%H:%M:%S"),
                    "_save": "Save",
                    "csrfmiddlewaretoken": http.cookies["csrftoken"],
                },
            )
            assert done.status_code == 302, done.text[-2000:]
            assert close_code(socket) == 4403
        assert get_user_model().objects.get(pk=owner.pk).is_active is False
        assert refused_status(gateway, serving.token) == 403
