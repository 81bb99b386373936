"""Reaching expert workers behind NAT through the gateway's expert relay (`mesh.experts.consumers`).

The relay carries the worker's ordinary `mahout.link` connection as bytes (`mahout.relay`):
the handshake with the worker's secret and the AES-GCM sealing of every frame run end to end
between the coordinator and the worker, so the gateway sees only the handshake and
ciphertext, and a frame it alters fails its tag and drops the link (the coordinator then
computes those experts itself). The gateway still admits only the worker's own host at the
worker's end and its model's coordinator at the other.

* `RelayWorkerLink` (worker side): holds ``…/api/moe/relay/worker/<id>`` open (reconnecting
  with bounded backoff); each connection the coordinator opens through it becomes a loopback
  connection to the worker's own `ExpertServer`, which admits and serves it as a direct one.
* `RelayTransport` (coordinator side): a `TcpTransport` to a loopback `Portal` standing for
  the worker, each connection carried over ``…/api/moe/relay/coordinator/<id>``; any
  failure or timeout raises `WorkerFailed`, so the coordinator computes locally.
"""

from __future__ import annotations

from collections.abc import Callable

from mahout import relay
from mahout.moe.coordinator import TcpTransport
from mahout.moe.worker import ExpertServer

__all__ = ["RelayTransport", "RelayWorkerLink", "relay_url"]

RELAY_DIAL_TIMEOUT_SECONDS = 5.0  # the portal's WebSocket to the gateway, then the handshake through it


def relay_url(server: str, role: str, worker_id: int) -> str:
    return f"{relay.websocket_base(server)}/api/moe/relay/{role}/{worker_id}"


class RelayWorkerLink(relay.ListenerRelay):
    """Carries the coordinator's connections to `server` through the relay until stopped."""

    def __init__(
        self, server_url: str, token: str, worker_id: int, server: ExpertServer, *, out: Callable[[str], None] = print
    ) -> None:
        super().__init__(
            relay_url(server_url, "worker", worker_id), token, server.address, what="expert relay", out=out
        )


class RelayTransport(TcpTransport):
    """A coordinator's sealed link to one worker through the relay, admitted with the worker's
    `secret`; its portal closes with it."""

    def __init__(self, server_url: str, token: str, worker_id: int, secret: str) -> None:
        self.url = relay_url(server_url, "coordinator", worker_id)
        self.portal = relay.Portal(self.url, token)
        super().__init__(self.portal.address, secret, connect_timeout=RELAY_DIAL_TIMEOUT_SECONDS)

    def close(self) -> None:
        super().close()
        self.portal.close()
