"""The expert relay: workers behind NAT connect outward to the gateway, and their
coordinator reaches them through it (`mesh.relay` moves the bytes).

A worker listens on `ws …/api/moe/relay/worker/<id>` (only the worker's own host, while the
worker is not retired); its model's coordinator dials it with
`ws …/api/moe/relay/coordinator/<id>` (only that coordinator's host). What runs through is
the worker's ordinary `mahout.link`: the handshake with the worker's secret and the sealing
of every frame run end to end between the two hosts, so the relay sees only ciphertext and a
frame altered on the way drops the link. If the worker's socket closes, every coordinator
connected through it is closed at once (4410: it then computes those experts itself).
"""

from __future__ import annotations

from mesh.experts import selectors
from mesh.relay import DialConsumer, ListenerConsumer

__all__ = ["ExpertRelayCoordinatorConsumer", "ExpertRelayWorkerConsumer", "relay_group"]


def relay_group(worker_id: int) -> str:
    return f"moe-relay-{worker_id}"


class _WorkerRoute:
    ids: dict[str, int]

    def route(self, kwargs: dict[str, str]) -> dict[str, int]:
        return {"worker_id": int(kwargs["worker_id"])}

    def group(self) -> str:
        return relay_group(self.ids["worker_id"])


class ExpertRelayWorkerConsumer(_WorkerRoute, ListenerConsumer):
    """The worker's end: every connection its coordinator opens to it."""

    allowed = staticmethod(selectors.relay_worker_allowed)


class ExpertRelayCoordinatorConsumer(_WorkerRoute, DialConsumer):
    """The coordinator's end: one connection to the worker."""

    allowed = staticmethod(selectors.relay_coordinator_allowed)
