"""A ring's links each have their own secret, known to their two ends only (issue 50): a stage
admits its upstream neighbour (and, at the head and the tail, the bridge) and nobody else.
Another stage of the same ring, holding secrets of its own links, is refused at the handshake
whatever it claims to be, and nothing it could send reaches the stage's computation; the
expected neighbour's frames do. A frame the peer may not send (a request from a stage, ring
traffic from the bridge) drops the link unread.

The stages here are stand-ins for `engine.model.Stage` (they record what they compute), so no
weights are loaded: what is tested is who may put a frame on which link."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
import torch

from mahout.link import HEADERS_ONLY, Link, LinkRefused, accept, connect, listen
from mahout.ring.keys import StageKeys, ring_keys
from mahout.ring.membership import Limits, Row, rows_to_wire
from mahout.ring.stage import StageAgent

D_MODEL = 4
N_STAGES = 4
LIMITS = Limits(micro_batch=2, row_width=4)


class _Cache:
    n_ctx = 64
    n_rows = 4

    def release(self, request_id: str) -> None:
        pass

    def assign(self, request_id: str) -> int:
        return 0


class RecordingStage:
    """Stage `index` of an `N_STAGES` ring, one layer each: every pass it runs is recorded."""

    def __init__(self, index: int) -> None:
        self.start, self.end = index, index + 1
        self.is_head, self.is_tail = index == 0, index == N_STAGES - 1
        self.shares_output = False
        self.config = SimpleNamespace(vocab_size=16, d_model=D_MODEL)
        self.weights = SimpleNamespace(start=index)
        self.cache = _Cache()
        self.computed: list[torch.Tensor] = []

    def forward_rows(self, x: torch.Tensor, membership: object, *, normed: bool = False) -> torch.Tensor:
        self.computed.append(x.clone())
        return torch.ones(x.shape[0], D_MODEL) if x.dtype == torch.long else x * 2


class NextStage:
    """The stage after the one under test, as its dialler sees it: it admits its upstream
    neighbour with its own keys and collects what arrives."""

    def __init__(self, keys: StageKeys) -> None:
        self.server = listen()
        self.address = self.server.getsockname()[:2]
        self.keys = keys
        self.frames: list[tuple[dict, torch.Tensor | None]] = []
        self.link: Link | None = None
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        sock, _ = self.server.accept()
        self.link = accept(sock, secret_for=self.keys.secret_for, caps=LIMITS.frame_caps(d_model=D_MODEL, n_ctx=64))
        try:
            while True:
                self.frames.append(self.link.recv())
        except OSError:
            pass

    def close(self) -> None:
        self.server.close()
        if self.link is not None:
            self.link.close()


@pytest.fixture
def ring() -> Iterator[SimpleNamespace]:
    """Stage 1 (a middle stage) of a four-stage ring, serving; its next stage collects."""
    keys = ring_keys(N_STAGES)
    following = NextStage(keys[2])
    stage = RecordingStage(1)
    agent = StageAgent(stage, limits=LIMITS, keys=keys[1], next_address=following.address)  # type: ignore[arg-type]
    thread = threading.Thread(target=agent.serve, daemon=True)
    thread.start()
    assert agent.ready.wait(10)
    yield SimpleNamespace(keys=keys, agent=agent, stage=stage, following=following)
    agent.close()
    following.close()
    thread.join(5)


def _dial(agent: StageAgent, *, secret: str, hello: dict) -> Link:
    return connect(agent.address, secret=secret, hello=hello, caps=HEADERS_ONLY, timeout=5)


def _batch(link: Link, request_id: str, value: float) -> None:
    link.send(
        {"type": "batch", "rows": rows_to_wire([Row(request_id, 0, 2, "prefill", True)])},
        torch.full((2, D_MODEL), value),
    )


def _wait(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_non_adjacent_stage_is_refused_whatever_it_claims_and_only_the_upstream_neighbour_is_computed(ring) -> None:  # noqa: ANN001
    third = ring.keys[
        3
    ]  # stage 3: admitted to its own links (2 -> 3, 3 -> 0, the bridge's to the tail), not to stage 1's
    attempts = [
        (third.downstream, third.hello()),  # as itself, with a link secret of the same ring
        (third.downstream, {"role": "upstream", "stage": 0}),  # as stage 1's upstream neighbour (3 -> 0 is a ring link)
        (third.upstream, {"role": "upstream", "stage": 0}),
        (third.bridge, {"role": "bridge"}),  # as the bridge, with the bridge's link to the tail
        (ring.keys.bridge.head, {"role": "bridge"}),  # even the bridge's own secret: a middle stage has no bridge
    ]
    for secret, hello in attempts:
        with pytest.raises(LinkRefused):
            intruder = _dial(ring.agent, secret=secret, hello=hello)
            _batch(intruder, "injected", 9.0)  # (never reached: the handshake refused it)
    assert _wait(lambda: ring.agent.stats.peers_refused == len(attempts))

    upstream = _dial(ring.agent, secret=ring.keys[0].downstream, hello=ring.keys[0].hello())  # the real stage 0
    _batch(upstream, "job-1-a", 1.0)
    assert _wait(lambda: len(ring.following.frames) == 1)
    upstream.close()
    assert [x.tolist() for x in ring.stage.computed] == [torch.full((2, D_MODEL), 1.0).tolist()]  # its frames only
    header, hidden = ring.following.frames[0]
    assert (
        header["type"] == "batch"
        and header["rows"][0]["request_id"] == "job-1-a"
        and torch.equal(hidden, torch.full((2, D_MODEL), 2.0))
    )


def test_a_stage_that_claims_a_neighbours_index_cannot_prove_it() -> None:
    keys = ring_keys(3)
    head = keys[0]
    assert head.secret_for({"role": "upstream", "stage": 2}) == keys[2].downstream  # the tail closes the ring
    assert head.secret_for({"role": "upstream", "stage": 1}) is None
    assert head.secret_for({"role": "upstream", "stage": True}) is None
    assert head.secret_for({"role": "bridge"}) == keys.bridge.head
    assert keys[1].secret_for({"role": "bridge"}) is None
    assert keys[2].secret_for({"role": "bridge"}) == keys.bridge.tail
    assert keys[1].secret_for({"role": "coordinator"}) is None
    secrets = [keys.bridge.head, keys.bridge.tail, *(k.downstream for k in keys.stages)]
    assert len(set(secrets)) == len(secrets) == 5  # every link its own
    assert all(keys[i].downstream == keys[(i + 1) % 3].upstream for i in range(3))  # and both its ends hold it


def test_the_upstream_neighbour_may_not_submit_a_request_to_the_head() -> None:
    keys = ring_keys(N_STAGES)
    following = NextStage(keys[1])
    stage = RecordingStage(0)
    head = StageAgent(stage, limits=LIMITS, keys=keys[0], next_address=following.address)  # type: ignore[arg-type]
    thread = threading.Thread(target=head.serve, daemon=True)
    thread.start()
    try:
        assert head.ready.wait(10)
        tail = _dial(head, secret=keys[3].downstream, hello=keys[3].hello())  # admitted: the tail closes the ring
        tail.send({"type": "submit", "request_id": "forged", "prompt_ids": [1, 2], "max_tokens": 2})
        assert _wait(lambda: head.stats.frames_refused == 1)
        assert _wait(lambda: not thread.is_alive())  # its upstream link dropped: the session ends
        assert stage.computed == [] and following.frames == []  # the forged request never ran
    finally:
        head.close()
        following.close()
        thread.join(5)


def test_the_bridge_may_send_the_head_requests_and_nothing_else() -> None:
    keys = ring_keys(N_STAGES)
    following = NextStage(keys[1])
    stage = RecordingStage(0)
    head = StageAgent(stage, limits=LIMITS, keys=keys[0], next_address=following.address)  # type: ignore[arg-type]
    thread = threading.Thread(target=head.serve, daemon=True)
    thread.start()
    try:
        assert head.ready.wait(10)
        bridge = _dial(head, secret=keys.bridge.head, hello={"role": "bridge"})
        assert bridge.recv()[0]["type"] == "welcome"
        bridge.send({"type": "submit", "request_id": "job-2-a", "prompt_ids": [1, 2], "max_tokens": 2})
        assert _wait(lambda: len(following.frames) == 1)  # computed and handed on
        bridge.send(
            {"type": "tokens", "rows": [{"request_id": "job-2-a", "token": 3, "position": 2}]}
        )  # the tail's to send
        assert _wait(lambda: head.stats.frames_refused == 1)
        assert len(stage.computed) == 1  # the forged token made no decode
    finally:
        head.close()
        following.close()
        thread.join(5)
