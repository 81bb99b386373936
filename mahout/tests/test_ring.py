"""The ring: stages on loopback give the single-process engine's greedy tokens, alone and
packed; the membership the head decides is exactly what the tail runs; plans' widths are
enforced; stages report hold and idle time; a stage dying fails its requests honestly.
Strangers are refused at the handshake and learn nothing; the bridge cannot be replaced;
a frame over the plan's caps is refused."""

from __future__ import annotations

import gc
import json
import socket
import struct
import time
from pathlib import Path

import pytest
import torch

from engine.generate import build_stages, generate
from mahout.link import HEADERS_ONLY, FrameCaps, LinkClosed, LinkRefused, connect, new_secret
from mahout.ring.bridge import RingBridge, RingBroken, RingError
from mahout.ring.keys import BridgeKeys, ring_keys
from mahout.ring.local import ThreadRing, split_layers
from mahout.ring.membership import BatchTooWide, Limits, Row, rows_to_wire
from mahout.ring.stage import StageAgent

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [
    [2, 818, 5279, 529, 7001, 563],  # "The capital of France is"
    [2, 818, 5279, 529],
    [2, 7001, 563, 496, 2891, 529, 506, 5279, 236761],
    [2, 506, 9145],
]
MAX_TOKENS = 6
LIMITS = Limits(micro_batch=2, row_width=4)  # prompts longer than 4 tokens are fed in chunks


@pytest.fixture(scope="module")
def expected(model_path: Path) -> list[list[int]]:
    """Greedy tokens of the single-process engine, one request at a time."""
    (full,) = build_stages(model_path, [(0, 18)], n_rows=1, n_ctx=64)
    tokens = [generate([full], prompt, MAX_TOKENS).token_ids for prompt in PROMPTS]
    del full
    gc.collect()
    return tokens


def _ring(model_path: Path, n_stages: int, limits: Limits = LIMITS, slots: int = 4) -> ThreadRing:
    return ThreadRing(model_path, split_layers(18, n_stages), limits=limits, slots=slots, n_ctx=64)


class RingTests:
    @pytest.mark.parametrize("n_stages", [2, 3, 4])
    def test_it_gives_the_engines_greedy_tokens_alone_and_packed(
        self, n_stages: int, model_path: Path, expected: list[list[int]]
    ) -> None:
        with _ring(model_path, n_stages) as ring:
            head, tail = ring.agents[0], ring.agents[-1]
            head.trace, tail.trace = [], []
            alone = ring.bridge.submit(PROMPTS[0], MAX_TOKENS).result()
            packed = [ring.bridge.submit(prompt, MAX_TOKENS) for prompt in PROMPTS]
            got = [request.result() for request in packed]
            stats = ring.bridge.stats()
        assert alone == expected[0]
        assert got == expected
        assert all(request.finish_reason == "length" for request in packed)
        # membership forwarding is exact: the tail ran the very memberships the head decided
        assert tail.trace == head.trace
        assert max(len(rows) for rows in head.trace) == LIMITS.micro_batch  # requests shared passes
        assert len(stats) == n_stages
        for stage in stats:
            assert stage["hold_s"] > 0 and stage["idle_s"] >= 0
            assert stage["batches"] == stats[0]["batches"] and stage["tokens"] == stats[0]["tokens"]
            assert stage["queue_depth"] == 0
        del ring
        gc.collect()

    def test_it_refuses_a_batch_wider_than_the_plan(self, model_path: Path) -> None:
        with _ring(model_path, 2) as ring:
            tail = ring.agents[-1]
            rows = [Row(f"x{i}", 0, 1, "prefill", True) for i in range(3)]
            intruder = connect(
                tail.address, secret=ring.keys[0].downstream, hello=ring.keys[0].hello(), caps=HEADERS_ONLY
            )
            intruder.send({"type": "batch", "rows": rows_to_wire(rows)}, torch.zeros(3, 640))
            wide = [Row("y", 0, 5, "prefill", True)]
            intruder.send({"type": "batch", "rows": rows_to_wire(wide)}, torch.zeros(5, 640))
            deadline = time.monotonic() + 30
            while len(ring.bridge.errors) < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            messages = [error["message"] for error in ring.bridge.errors]
            intruder.close()
        assert any("batch of 3 rows exceeds the plan's micro-batch of 2" in m for m in messages), messages
        assert any("a row of 5 tokens exceeds the plan's row width of 4" in m for m in messages), messages
        assert tail.stats.tokens == 0  # nothing was computed

    def test_it_cancels_a_request_and_frees_its_cache_rows(self, model_path: Path, expected: list[list[int]]) -> None:
        with _ring(model_path, 2, slots=1) as ring:
            endless = ring.bridge.submit(PROMPTS[0], 50)
            queued = ring.bridge.submit(PROMPTS[1], MAX_TOKENS)  # waits: the only cache row is taken
            next(iter(endless))
            ring.bridge.cancel(endless.id)
            assert len(endless.result()) < 50 and endless.finish_reason == "cancelled"
            assert queued.result() == expected[1]

    def test_it_samples_reproducibly_for_a_seed_across_the_shared_output_head(self, model_path: Path) -> None:
        with _ring(model_path, 2) as ring:
            assert all(agent.stage.shares_output for agent in ring.agents)
            # one at a time: the engine's arithmetic depends on how rows are packed (in the last
            # digits of a logit), which may move a draw at the edge of a token's interval
            first, again, other = (
                ring.bridge.submit(PROMPTS[0], MAX_TOKENS, temperature=0.9, seed=seed).result() for seed in (5, 5, 6)
            )
        assert first == again and len(first) == MAX_TOKENS
        assert all(0 <= token < 262144 for token in first + other)

    def test_it_fails_a_request_honestly_when_the_head_holds_no_share_of_the_output(self, model_path: Path) -> None:
        (head,) = build_stages(model_path, [(0, 9)], n_rows=4, n_ctx=64)  # loaded as the single-process engine does
        (tail,) = build_stages(model_path, [(9, 18)], n_rows=4, n_ctx=64, share_output=True)
        with ThreadRing(model_path, [(0, 9), (9, 18)], limits=LIMITS, stages=[head, tail]) as ring:
            for _ in range(2):  # each request fails with the reason, and the ring is not broken by it
                with pytest.raises(RingError, match="holds no share of the output head") as failed:
                    ring.bridge.submit(PROMPTS[3], MAX_TOKENS).result()
                assert not isinstance(failed.value, RingBroken)

    def test_it_fails_open_requests_when_a_stage_dies(self, model_path: Path) -> None:
        with _ring(model_path, 3) as ring:
            request = ring.bridge.submit(PROMPTS[0], 40)
            next(iter(request))  # it is running
            ring.agents[1].close()
            with pytest.raises(RingBroken):
                request.result()
            with pytest.raises(RingBroken):
                ring.bridge.submit(PROMPTS[1], 4).result()


def _frame(header: dict) -> bytes:
    head = json.dumps(header).encode()
    return struct.pack(">II", len(head), 0) + head


def _read_all(sock: socket.socket) -> bytes:
    """Everything the peer sends until it closes (or 5 s of silence)."""
    sock.settimeout(5)
    data = b""
    while chunk := sock.recv(1 << 16):
        data += chunk
    return data


def _challenge_only(data: bytes) -> bool:
    n_head, n_payload = struct.unpack(">II", data[:8])
    return json.loads(data[8 : 8 + n_head])["type"] == "challenge" and len(data) == 8 + n_head + n_payload


class RingAdmissionTests:
    def test_a_stranger_is_refused_at_every_stage_and_learns_nothing(
        self, model_path: Path, expected: list[list[int]]
    ) -> None:
        with _ring(model_path, 3) as ring:
            heard = []
            for agent in ring.agents:
                for hello in ({"type": "hello", "role": "bridge"}, {"type": "hello", "role": "upstream", "stage": 0}):
                    stranger = socket.create_connection(agent.address, timeout=5)
                    stranger.sendall(_frame(hello))  # the unauthenticated hello that used to be enough
                    stranger.sendall(
                        _frame({"type": "submit", "request_id": "x", "prompt_ids": PROMPTS[0], "max_tokens": 4})
                    )
                    heard.append(_read_all(stranger))
                    stranger.close()
            tokens = ring.bridge.submit(PROMPTS[0], MAX_TOKENS).result()  # the ring serves on, untouched
            refused = [agent.stats.peers_refused for agent in ring.agents]
        assert all(_challenge_only(data) for data in heard), "a stranger got more than the challenge"
        assert refused == [2, 2, 2]
        assert tokens == expected[0]

    def test_the_bridge_cannot_be_replaced(self, model_path: Path, expected: list[list[int]]) -> None:
        with _ring(model_path, 2) as ring:
            tail = ring.agents[-1]
            stranger = socket.create_connection(tail.address, timeout=5)
            stranger.sendall(_frame({"type": "hello", "role": "bridge"}))
            with pytest.raises(
                LinkRefused, match="already has this session's bridge"
            ):  # the secret is not enough either
                RingBridge(ring.agents[0].address, tail.address, keys=ring.keys.bridge, timeout=5)
            with pytest.raises(LinkRefused, match="refused our proof"):
                RingBridge(ring.agents[0].address, tail.address, keys=BridgeKeys(new_secret(), new_secret()), timeout=5)
            request = ring.bridge.submit(PROMPTS[0], MAX_TOKENS)
            tokens = request.result()
            stolen = _read_all(stranger)
            stranger.close()
            assert tail.stats.peers_refused >= 2
        assert tokens == expected[0], "every token reached the real bridge"
        assert _challenge_only(stolen), "the stranger that said it was the bridge got no token"

    def test_a_frame_over_the_plans_caps_is_refused_unread(self, model_path: Path) -> None:
        with _ring(model_path, 2) as ring:
            tail = ring.agents[-1]
            caps = tail.caps
            assert caps == LIMITS.frame_caps(d_model=640, n_ctx=64)
            assert caps.payload_bytes == LIMITS.micro_batch * LIMITS.row_width * 640 * 4  # one pass's hidden state
            intruder = connect(
                tail.address, secret=ring.keys[0].downstream, hello=ring.keys[0].hello(), caps=HEADERS_ONLY
            )
            intruder.sock.sendall(struct.pack(">II", 64, caps.payload_bytes + 1))  # one byte too many, never sent
            with pytest.raises(LinkClosed):
                intruder.recv()  # the tail dropped the link at the prefix
            assert tail.stats.tokens == 0
            intruder.close()


class FrameCapsTests:
    def test_the_caps_follow_the_plans_widths_and_window(self) -> None:
        small, wide = Limits(micro_batch=2, row_width=4), Limits(micro_batch=8, row_width=64)
        grammar = 256 * 1024  # a submit may carry a response_format's grammar
        assert small.frame_caps(d_model=640, n_ctx=64) == FrameCaps(
            64 * 1024 + 64 * 12 + grammar + 2 * 512, 2 * 4 * 640 * 4
        )
        assert wide.frame_caps(d_model=640, n_ctx=1024).payload_bytes == 8 * 64 * 640 * 4  # 1.3 MB, not 1 GiB
        assert (
            wide.frame_caps(d_model=640, n_ctx=4096).header_bytes > 4096 * 7 + grammar
        )  # a whole prompt fits a submit
        # a head sharing the output head reads the tail's half of the logits for a pass's top-p rows
        assert small.frame_caps(d_model=640, n_ctx=64, tail_vocab=131_072).payload_bytes == 2 * 131_072 * 4


class HeadPackingTests:
    def test_it_packs_a_decode_and_a_prefill_chunk_into_one_pass(self, model_path: Path) -> None:
        (stage,) = build_stages(model_path, [(0, 1)], n_rows=4, n_ctx=64)
        head = StageAgent(stage, limits=LIMITS, keys=ring_keys(2)[0], next_address=("127.0.0.1", 9))
        head._submit({"request_id": "a", "prompt_ids": PROMPTS[3], "max_tokens": 4})
        rows, ids = head._pack()
        assert rows == [Row("a", 0, 3, "prefill", True)] and ids == PROMPTS[3]
        head._tokens([{"request_id": "a", "token": 77}])  # back from the tail
        head._submit({"request_id": "b", "prompt_ids": PROMPTS[2], "max_tokens": 4})
        rows, ids = head._pack()
        assert rows == [Row("a", 3, 1, "decode", True), Row("b", 0, 4, "prefill", False)]
        assert ids == [77, *PROMPTS[2][:4]]
        rows, _ = head._pack()  # b's next chunk follows at once; a waits for its token
        assert rows == [Row("b", 4, 4, "prefill", False)]
        head.server.close()


class LimitsTests:
    def test_it_refuses_nonpositive_widths(self) -> None:
        with pytest.raises(ValueError):
            Limits(micro_batch=0, row_width=4)
        with pytest.raises(ValueError):
            Limits(micro_batch=2, row_width=-1)

    def test_it_refuses_a_membership_that_does_not_match_the_tensor(self) -> None:
        with pytest.raises(BatchTooWide, match="tensor holds 3"):
            LIMITS.check([Row("a", 0, 2, "prefill", True)], 3)
        with pytest.raises(BatchTooWide, match="twice"):
            LIMITS.check([Row("a", 0, 1, "decode", True), Row("a", 1, 1, "decode", True)], 2)


class SplitTests:
    def test_it_refuses_a_one_stage_pipeline(self) -> None:
        with pytest.raises(ValueError, match="a pipeline needs at least two stages"):
            split_layers(18, 1)
        assert split_layers(18, 2) == [(0, 9), (9, 18)]
