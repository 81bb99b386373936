"""HTTP client for the gateway's ring API (``/api/rings/``): a host proposes a ring on its
own machine; a stage host pulls its assignment and reports where its agent listens; stage
hosts and the bridge read where the others listen (all outbound); a bridge reports the
stages' hold/idle seconds and queue depth. Each link of the ring has its own secret
(`mahout.ring.keys`): a stage host's assignment carries its stages' links' secrets, and the
bridge reads its two links' from `bridge_keys`.

It is `mahout.api.HostApi` (same host token, timeouts, bounded retries with backoff, typed
4xx errors) pointed at the ring routes instead of the host routes.
"""

from __future__ import annotations

from typing import Any

from mahout.api import HostApi
from mahout.ring.keys import BridgeKeys

__all__ = ["RingApi"]


class RingApi(HostApi):
    def __init__(self, server: str, token: str, **kwargs: Any) -> None:
        super().__init__(server, token, **kwargs)
        self.server, self.token = server, token  # for the ring relay's WebSockets (`mahout.ring.relay`)
        self._client.base_url = server.rstrip("/") + "/api/rings"

    def propose(self, *, model: str, stages: int, row_width: int, micro_batch: int) -> dict:
        """A ring of `stages` stages all on this host, which bridges it (an existing one is reused)."""
        body = {"model": model, "stages": stages, "row_width": row_width, "micro_batch": micro_batch}
        return self._json(self._request("POST", "/own", body))

    def report_address(self, ring_id: int, stage: int, address: str) -> dict:
        """Say where this host's agent for `stage` listens (``HOST:PORT``)."""
        return self._json(self._request("POST", f"/{ring_id}/stages/{stage}/address", {"address": address}))

    def leave(self, ring_id: int, stage: int, address: str) -> bool:
        """Say this host's agent for `stage` no longer listens at `address` (as the gateway
        answered `report_address`): the gateway forgets it unless a newer one was reported."""
        body = {"address": address}
        return bool(self._json(self._request("POST", f"/{ring_id}/stages/{stage}/leave", body)).get("cleared"))

    def addresses(self, ring_id: int) -> list[dict]:
        """Every stage of the ring with the address it last reported ("" until it has)."""
        return self._json(self._request("GET", f"/{ring_id}/addresses")).get("stages", [])

    def assignment(self) -> list[dict]:
        """The stages of active ring plans this host must serve (each with its links' secrets, ``links``)."""
        return self._json(self._request("GET", "/assignment")).get("assignments", [])

    def bridge_keys(self, ring_id: int) -> BridgeKeys:
        """The secrets of the bridge's links to the ring's head and tail, for its bridge host only."""
        answer = self._json(self._request("GET", f"/{ring_id}/secret"))
        return BridgeKeys(head=str(answer["head"]), tail=str(answer["tail"]))

    def report_stats(self, ring_id: int, stages: list[dict]) -> dict:
        """Report stages' time use, as collected around the ring (`RingBridge.stats`)."""
        keep = ("stage", "hold_s", "idle_s", "queue_depth", "batches")
        body = {"stages": [{key: stage[key] for key in keep if key in stage} for stage in stages]}
        return self._json(self._request("POST", f"/{ring_id}/stats", body))

    def stats(self, ring_id: int) -> dict:
        """Every stage's last reported time use, with its hold share."""
        return self._json(self._request("GET", f"/{ring_id}/stats"))
