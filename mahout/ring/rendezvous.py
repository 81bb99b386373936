"""Finding ring neighbours through the control plane (every call outbound from the host).

A stage binds its listening socket, reports the address it can be reached at
(`RingApi.report_address`), then polls the ring's addresses until its next stage has
reported one that answers. The bridge does the same for the head and the tail. Only
addresses travel through the gateway; hidden states still go agent to agent.

A stage behind NAT reports `RELAY_ADDRESS` instead: it is dialled through the gateway's ring
relay (`mahout.ring.relay.relay_portal`, a loopback port standing for it), the handshake the same.

An address can be stale (a stage that died without saying so keeps its last report):
a dial that fails is retried with a freshly read address until the deadline, then
`RendezvousTimeout` says which stage never answered and what it had reported. A dial
passes the link's handshake (`mahout.link`) with that link's own secret (`mahout.ring.keys`):
whatever listens at a stale address without it is dialled again, never sent a hidden state
or a prompt.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from mahout.api import ServerUnavailable
from mahout.link import FrameCaps, Link, LinkClosed, connect
from mahout.ring.api import RingApi
from mahout.ring.bridge import CAPS as BRIDGE_CAPS
from mahout.ring.bridge import HELLO as BRIDGE_HELLO
from mahout.ring.bridge import RingBridge
from mahout.ring.keys import BridgeKeys
from mahout.ring.relay import RELAY_ADDRESS, relay_portal

__all__ = ["RendezvousTimeout", "advertised_address", "bridge_connect", "dial_stage", "parse_address"]

DIAL_TIMEOUT_SECONDS = 3.0  # one attempt at a reported address before reading the addresses again
POLL_SECONDS = 0.5


class RendezvousTimeout(TimeoutError):
    """A neighbour did not report a reachable address in time."""


def parse_address(text: str, *, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too; a bare ``:PORT`` means `default_host`) -> (host, port)."""
    host, colon, port = text.strip().rpartition(":")
    if not colon or not port.isdigit():
        raise ValueError(f"{text!r} is not HOST:PORT")
    return (host.strip("[]") or default_host), int(port)


def _format(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def route_to(server_url: str) -> str:
    """This machine's IP address on the route to the control plane (no packet is sent)."""
    target = urlsplit(server_url).hostname or "127.0.0.1"
    family = socket.AF_INET6 if ":" in target else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((target, 9))
        return str(probe.getsockname()[0])


def advertised_address(server: socket.socket, advertise: str | None, server_url: str) -> str:
    """The ``HOST:PORT`` neighbours should dial for a socket bound as `server`.

    `advertise` wins (``HOST:PORT``, or ``HOST`` to keep the bound port: behind a port
    forward or a NAT give the outside address). Otherwise the bound address, unless it is a
    wildcard (0.0.0.0): then this machine's address on the route to the control plane.
    """
    bound_host, bound_port = server.getsockname()[:2]
    if advertise:
        if ":" in advertise and not advertise.startswith("["):
            host, port = parse_address(advertise)
            return _format(host, port)
        return _format(advertise.strip("[]"), bound_port)
    host = route_to(server_url) if _is_wildcard(bound_host) else bound_host
    return _format(host, bound_port)


def dial_stage(
    api: RingApi,
    ring_id: int,
    index: int,
    *,
    secret: str,
    hello: dict[str, Any],
    caps: FrameCaps,
    timeout: float,
    name: str = "",
    say: Callable[[str], None] = print,
    poll: float = POLL_SECONDS,
    dial_timeout: float = DIAL_TIMEOUT_SECONDS,
) -> Link:
    """Connect to stage `index` of the ring once it has reported an address that answers and
    passes the handshake with `secret`."""
    deadline = time.monotonic() + timeout
    last, problem = "", "it has not reported an address"
    waiting_said = False
    while True:
        try:
            address = _address_of(api, ring_id, index)
        except ServerUnavailable as exc:
            address, problem = "", f"the control plane is unreachable ({exc})"
        if address:
            if address != last:
                say(f"mahout: stage {index} of ring {ring_id} reported {address}; connecting")
            last = address
            remaining = deadline - time.monotonic()
            target = (
                relay_portal(api.server, api.token, ring_id, index)
                if address == RELAY_ADDRESS
                else parse_address(address)
            )
            try:
                return connect(
                    target,
                    secret=secret,
                    hello=hello,
                    caps=caps,
                    timeout=max(0.1, min(dial_timeout, remaining)),
                    name=name or f"stage{index}",
                )
            except LinkClosed as exc:
                problem = f"its reported address {address} does not answer ({exc})"
        elif not waiting_said:
            say(f"mahout: waiting for stage {index} of ring {ring_id} to report its address")
            waiting_said = True
        if time.monotonic() + poll >= deadline:
            raise RendezvousTimeout(
                f"stage {index} of ring {ring_id} was not reachable within {timeout:.0f} s: {problem} "
                f"(is `python -m mahout stage --ring {ring_id} --stage {index}` running on its host?)"
            )
        time.sleep(poll)


def _address_of(api: RingApi, ring_id: int, index: int) -> str:
    for stage in api.addresses(ring_id):
        if stage["stage"] == index:
            return str(stage.get("address") or "")
    raise ValueError(f"ring {ring_id} has no stage {index}")


def bridge_connect(
    api: RingApi,
    ring_id: int,
    n_stages: int,
    *,
    keys: BridgeKeys,
    timeout: float,
    say: Callable[[str], None] = print,
) -> RingBridge:
    """The bridge of a control-plane ring: dial the tail, then the head, at their reported addresses.

    A stage that answers the dial but leaves before its welcome (its ring session was ending)
    is dialled again, until `timeout`.
    """
    deadline = time.monotonic() + timeout

    def dial(index: int, name: str) -> Link:
        secret = keys.tail if index == n_stages - 1 else keys.head
        return dial_stage(
            api,
            ring_id,
            index,
            secret=secret,
            hello=BRIDGE_HELLO,
            caps=BRIDGE_CAPS,
            timeout=max(0.1, deadline - time.monotonic()),
            name=name,
            say=say,
        )

    while True:
        tail = dial(n_stages - 1, "tail")
        try:
            head = dial(0, "head")
        except BaseException:
            tail.close()
            raise
        try:
            return RingBridge.over(head, tail)
        except LinkClosed as exc:
            if time.monotonic() >= deadline:
                raise RendezvousTimeout(
                    f"ring {ring_id}: the head or the tail left before greeting the bridge: {exc}"
                ) from exc
            say(f"mahout: ring {ring_id}: a stage left while the bridge was joining ({exc}); trying again")
            time.sleep(POLL_SECONDS)
