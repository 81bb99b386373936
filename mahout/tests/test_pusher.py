"""BatchPusher: ordered batches sent off the generating thread, errors surfaced to it."""
from __future__ import annotations

import time

import pytest

from mahout.api import JobGoneError
from mahout.pusher import BatchPusher


class SlowApi:
    """Records pushes; each takes ``latency`` seconds; raises ``error`` from push ``fail_at`` on."""

    def __init__(self, latency: float = 0.0, fail_at: int | None = None) -> None:
        self.latency, self.fail_at = latency, fail_at
        self.pushes: list[tuple[int, str]] = []

    def push_tokens(self, job_id: object, *, seq: int, text: str) -> dict:
        time.sleep(self.latency)
        self.pushes.append((seq, text))
        if self.fail_at is not None and len(self.pushes) > self.fail_at:
            raise JobGoneError(409, "job is not running")
        return {"accepted": True, "next_seq": seq + 1}


class BatchPusherTests:
    def test_it_batches_pieces_in_order_while_a_push_is_in_flight(self):
        api = SlowApi(latency=0.1)
        started = time.monotonic()
        with BatchPusher(api, "job", interval=0.05) as pusher:
            for index in range(20):
                pusher.add(f"{index},")
                time.sleep(0.01)
            adding_took = time.monotonic() - started
            pusher.flush()
        assert adding_took < 0.5  # generation never waited on the 100 ms pushes
        assert [seq for seq, _ in api.pushes] == list(range(len(api.pushes)))
        assert "".join(text for _, text in api.pushes) == "".join(f"{i}," for i in range(20))
        assert api.pushes[0] == (0, "0,") and 2 <= len(api.pushes) <= 8

    def test_it_sends_nothing_for_an_empty_job(self):
        api = SlowApi()
        with BatchPusher(api, "job") as pusher:
            pusher.flush()
        assert api.pushes == []

    def test_it_raises_the_push_error_to_the_generating_thread(self):
        api = SlowApi(fail_at=0)
        with pytest.raises(JobGoneError):
            with BatchPusher(api, "job", interval=0.0) as pusher:
                for _ in range(100):
                    pusher.add("x")
                    time.sleep(0.005)
        assert len(api.pushes) == 1

    def test_it_drops_unsent_text_when_generation_fails(self):
        api = SlowApi(latency=0.05)
        with pytest.raises(RuntimeError):
            with BatchPusher(api, "job", interval=0.05) as pusher:
                pusher.add("sent")
                time.sleep(0.01)
                pusher.add("dropped")
                raise RuntimeError("runner broke")
        time.sleep(0.1)
        assert api.pushes == [(0, "sent")]
