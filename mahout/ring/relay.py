"""Ring stages behind NAT, reached through the gateway's ring relay (`mesh.rings.consumers`).

Every call is outbound from the host, so two stages each behind its own home router form a
ring. Nothing above the socket changes: the link's handshake and sealing (`mahout.link`) run
end to end through the relay, which only moves bytes (`mahout.relay` carries them).

* `StageRelay` (the stage's side): holds ``…/api/rings/<ring>/relay/stage/<index>`` open;
  each connection the gateway announces becomes a loopback connection to the stage's own
  listening socket.
* `relay_portal` (the dialler's side, a stage's upstream or the bridge): a loopback port
  standing for a relayed stage; each connection to it is carried over its own
  ``…/relay/dial/<index>`` WebSocket. `mahout.ring.rendezvous.dial_stage` dials it when the
  stage reported `protocol.ring.RELAY_ADDRESS`.
"""

from __future__ import annotations

from collections.abc import Callable

from mahout import relay
from mahout.relay import websocket_base
from protocol.ring import RELAY_ADDRESS

__all__ = ["RELAY_ADDRESS", "StageRelay", "relay_portal", "stage_relay_url"]


def stage_relay_url(server: str, ring_id: int, role: str, index: int) -> str:
    return f"{websocket_base(server)}/api/rings/{ring_id}/relay/{role}/{index}"


class StageRelay(relay.ListenerRelay):
    """Carries the connections dialled to stage `index` through the relay to `local`, the
    stage's own listening socket, until stopped."""

    def __init__(
        self,
        server: str,
        token: str,
        ring_id: int,
        index: int,
        local: tuple[str, int],
        *,
        out: Callable[[str], None] = print,
    ) -> None:
        super().__init__(stage_relay_url(server, ring_id, "stage", index), token, local, what="ring relay", out=out)


def relay_portal(server: str, token: str, ring_id: int, index: int) -> tuple[str, int]:
    """The loopback address standing for stage `index` of the ring, reached through the relay
    (one per stage and process, made on first use)."""
    return relay.relay_portal(stage_relay_url(server, ring_id, "dial", index), token)
