"""BatchPusher: ordered batches sent off the generating thread, errors surfaced to it."""

from __future__ import annotations

import threading
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


class GatedApi:
    """Records pushes; each stays in flight until the test opens ``gate``."""

    def __init__(self) -> None:
        self.gate, self.in_flight = threading.Event(), threading.Event()
        self.pushes: list[tuple[int, str]] = []

    def push_tokens(self, job_id: object, *, seq: int, text: str) -> dict:
        self.in_flight.set()
        self.gate.wait(10)
        self.pushes.append((seq, text))
        return {"accepted": True, "next_seq": seq + 1}


class BatchPusherTests:
    def test_it_batches_pieces_in_order_while_a_push_is_in_flight(self):
        api = GatedApi()
        with BatchPusher(api, "job", interval=0.05) as pusher:
            pusher.add("0,")
            assert api.in_flight.wait(10)
            for index in range(1, 20):
                pusher.add(f"{index},")
            assert api.pushes == [], "generation never waited on the push in flight"
            api.gate.set()
            pusher.flush()
        assert api.pushes == [(0, "0,"), (1, "".join(f"{i}," for i in range(1, 20)))]

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


class FinishApi:
    """Records pushes with the finish_reason each carried."""

    def __init__(self) -> None:
        self.pushes: list[tuple[int, str, str]] = []

    def push_tokens(self, job_id: object, *, seq: int, text: str, finish_reason: str = "") -> dict:
        self.pushes.append((seq, text, finish_reason))
        return {"accepted": True, "next_seq": seq + 1}


class FinishReasonTests:
    def test_the_last_batch_carries_the_finish_reason(self):
        api = FinishApi()
        with BatchPusher(api, "job", interval=10) as pusher:
            pusher.add("Hello")
            pusher.flush(finish_reason="stop")
        assert api.pushes[-1][1:] == ("Hello", "stop") and all(not finish for _, _, finish in api.pushes[:-1])

    def test_an_answer_already_sent_ends_with_an_empty_batch_that_says_so(self):
        api = FinishApi()
        with BatchPusher(api, "job", interval=0.01) as pusher:
            pusher.add("Hello")
            deadline = time.monotonic() + 10
            while not api.pushes and time.monotonic() < deadline:
                time.sleep(0.01)
            pusher.flush(finish_reason="length")
        assert api.pushes == [(0, "Hello", ""), (1, "", "length")]

    def test_a_reason_the_gateway_would_refuse_is_not_sent(self):
        api = FinishApi()
        with BatchPusher(api, "job") as pusher:
            pusher.add("Hi")
            pusher.flush(finish_reason="tool_calls")
        assert api.pushes == [(0, "Hi", "")]
