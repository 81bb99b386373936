"""The ring relay: stages behind NAT hold a socket open to the gateway, and their neighbours
and the bridge reach them through it, as they would dial them directly (`mesh.relay` moves
the bytes; the link's handshake and sealing run end to end through it).

A stage that reported the relay address (`protocol.ring.RELAY_ADDRESS`) listens on
`ws …/api/rings/<ring>/relay/stage/<index>` (it must run that stage of an active ring); a
participant of the ring dials it with `ws …/api/rings/<ring>/relay/dial/<index>`.
"""

from __future__ import annotations

from mesh.relay import DialConsumer, ListenerConsumer
from mesh.rings import selectors

__all__ = ["RingRelayDialConsumer", "RingRelayStageConsumer", "ring_relay_group"]


def ring_relay_group(plan_id: int, index: int) -> str:
    return f"ring-relay-{plan_id}-{index}"


class _RingRoute:
    ids: dict[str, int]

    def route(self, kwargs: dict[str, str]) -> dict[str, int]:
        return {"plan_id": int(kwargs["ring_id"]), "index": int(kwargs["index"])}

    def group(self) -> str:
        return ring_relay_group(self.ids["plan_id"], self.ids["index"])


class RingRelayStageConsumer(_RingRoute, ListenerConsumer):
    """The stage's end: every connection dialled to it."""

    allowed = staticmethod(selectors.relay_stage_allowed)


class RingRelayDialConsumer(_RingRoute, DialConsumer):
    """One connection to a stage."""

    allowed = staticmethod(selectors.relay_dial_allowed)
