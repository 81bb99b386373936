"""Host start-up: registering a qualification with a gateway that may not be up yet."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from mahout.api import HostApi, HostApiError
from mahout.host import Qualified, default_threads, register_when_reachable

MODEL = Qualified(Path("m.gguf"), "sha", {"gen_tps": 1.0}, "fp", {"hostname": "box"})


def api_answering(*statuses: int) -> tuple[HostApi, list[httpx.Request]]:
    seen: list[httpx.Request] = []
    answers = list(statuses)

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        status = answers.pop(0)
        return httpx.Response(status, json={"model": "gemma-3-270m", "fingerprint": "fp"} if status == 201 else {})

    return HostApi("http://gw.test", "t", retries=0, transport=httpx.MockTransport(handle)), seen


class RegisterWhenReachableTests:
    def test_it_waits_for_an_unreachable_gateway(self):
        api, seen = api_answering(503, 503, 201)
        lines, sleeps = [], []
        answer = register_when_reachable(api, MODEL, out=lines.append, retry_s=3.0, sleep=sleeps.append)
        assert answer == {"model": "gemma-3-270m", "fingerprint": "fp"}
        assert len(seen) == 3 and sleeps == [3.0, 3.0]
        assert lines[0].startswith("mahout: server unavailable") and lines[0].endswith("retrying in 3 s")

    def test_it_raises_a_refusal_at_once(self):
        api, seen = api_answering(401)
        with pytest.raises(HostApiError):
            register_when_reachable(api, MODEL, out=lambda _line: None, sleep=lambda _s: None)
        assert len(seen) == 1

    def test_it_uses_at_least_one_thread(self):
        assert default_threads() >= 1
