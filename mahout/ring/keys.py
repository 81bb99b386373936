"""A ring's link secrets: one per link, known to that link's two ends only.

A ring's links are stage i -> stage i+1 (the tail's next stage is the head, which closes
the ring) and the bridge's two, bridge -> head and bridge -> tail. The gateway issues one
secret per link (`mesh.rings.selectors.stage_links`: derived from the plan's own secret,
which never leaves the gateway); a local ring makes its own (`ring_keys`). So

* a stage holds the secrets of its own links only: its upstream's (the link it is dialled
  on by stage i-1), its downstream's (the link it dials, to stage i+1) and, at the head and
  the tail, the bridge's link to it (`StageKeys`);
* the bridge holds its two links' (`BridgeKeys`).

A stage's listener admits the upstream neighbour it expects and, at the head and the tail,
the bridge, each with that link's secret (`StageKeys.secret_for`, `mahout.link.accept`):
another stage of the same ring, though admitted to its own links, cannot prove this one, and
one that claims to be the upstream neighbour without being it cannot either. A disputed
link (two ends' evidence that disagree, `mahout.ring.blame`) is then a dispute between the
only two machines that could have sent or received its frames.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mahout.link import new_secret

__all__ = ["BridgeKeys", "RingKeys", "StageKeys", "ring_keys"]

UPSTREAM = "upstream"  # a stage's hello to its next stage: {"role": UPSTREAM, "stage": its index}
BRIDGE = "bridge"  # the bridge's hello to the head and the tail


@dataclass(frozen=True)
class StageKeys:
    """What stage `index` of an `n_stages` ring holds: its upstream link's secret (stage
    ``index - 1`` dials it with it), its downstream link's (it dials stage ``index + 1``) and,
    at the head or the tail, the bridge's link to it (None elsewhere)."""

    index: int
    n_stages: int
    upstream: str
    downstream: str
    bridge: str | None = None

    def __post_init__(self) -> None:
        if self.n_stages < 2 or not 0 <= self.index < self.n_stages:
            raise ValueError(f"stage {self.index} of a ring of {self.n_stages} stages")

    @property
    def upstream_index(self) -> int:
        return (self.index - 1) % self.n_stages

    @property
    def downstream_index(self) -> int:
        return (self.index + 1) % self.n_stages

    @property
    def faces_bridge(self) -> bool:
        """The head and the tail are dialled by the bridge; a middle stage never is."""
        return self.index in (0, self.n_stages - 1)

    def hello(self) -> dict[str, Any]:
        """What this stage says when it dials its next stage."""
        return {"role": UPSTREAM, "stage": self.index}

    def secret_for(self, claimed: dict[str, Any]) -> str | None:
        """The secret a peer claiming `claimed` (its hello's role and stage) must prove; None
        for anyone this stage does not expect: a stage that is not its upstream neighbour, a
        bridge at a middle stage, any other role."""
        role = claimed.get("role")
        if role == UPSTREAM and claimed.get("stage") == self.upstream_index and type(claimed.get("stage")) is int:
            return self.upstream
        if role == BRIDGE and self.faces_bridge:
            return self.bridge
        return None

    @classmethod
    def from_wire(cls, index: int, n_stages: int, links: dict[str, Any]) -> StageKeys:
        """From the gateway's assignment (``links``: ``{"upstream": {"stage", "secret"},
        "downstream": {"stage", "secret"}, "bridge": secret or null}``), checked against the
        plan's shape."""
        keys = cls(
            index=index,
            n_stages=n_stages,
            upstream=str(links["upstream"]["secret"]),
            downstream=str(links["downstream"]["secret"]),
            bridge=links.get("bridge") or None,
        )
        if links["upstream"]["stage"] != keys.upstream_index or links["downstream"]["stage"] != keys.downstream_index:
            raise ValueError(f"the gateway's links for stage {index} do not match a ring of {n_stages} stages")
        return keys


@dataclass(frozen=True)
class BridgeKeys:
    """The bridge's two links' secrets: to the head and to the tail."""

    head: str
    tail: str


@dataclass(frozen=True)
class RingKeys:
    """Every link secret of a ring (only whoever makes the ring holds them all: the gateway,
    or a local ring's own process)."""

    stages: tuple[StageKeys, ...]
    bridge: BridgeKeys

    def __getitem__(self, index: int) -> StageKeys:
        return self.stages[index]


def ring_keys(n_stages: int) -> RingKeys:
    """Fresh secrets for every link of a local ring of `n_stages` stages."""
    if n_stages < 2:
        raise ValueError("a pipeline needs at least two stages")
    links = [new_secret() for _ in range(n_stages)]  # links[i]: stage i -> stage i+1 (the tail's: -> the head)
    bridge = BridgeKeys(head=new_secret(), tail=new_secret())
    stages = tuple(
        StageKeys(
            index=i,
            n_stages=n_stages,
            upstream=links[(i - 1) % n_stages],
            downstream=links[i],
            bridge=bridge.head if i == 0 else bridge.tail if i == n_stages - 1 else None,
        )
        for i in range(n_stages)
    )
    return RingKeys(stages=stages, bridge=bridge)
