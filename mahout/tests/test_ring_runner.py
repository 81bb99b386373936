"""The ring behind the normal host loop: jobs are claimed, streamed, completed or failed
through the host API; a stage dying fails the job honestly."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.generate import build_stages, generate
from mahout.api import HostApi
from mahout.loop import HostLoop
from mahout.ring.local import ThreadRing, split_layers
from mahout.ring.membership import Limits
from mahout.ring.runner import RingRunner
from mahout.ring.serve import ring_loops, run_loops
from mahout.tests.fake_gateway import FakeGateway

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "gemma-3-270m"


def _loop(api: HostApi, runner: RingRunner, home: Path) -> HostLoop:
    return HostLoop(
        api,
        {MODEL: runner},
        fingerprint="f" * 64,
        home=home,
        claim_wait=0.2,
        heartbeat_interval=0.05,
        pause_poll=0.01,
        error_backoff=0.01,
        out=lambda _line: None,
    )


class RingRunnerTests:
    def test_it_serves_a_job_through_the_host_api_and_fails_one_when_a_stage_dies(
        self, model_path: Path, gateway: FakeGateway, api: HostApi, tmp_path: Path
    ) -> None:
        with ThreadRing(model_path, split_layers(18, 2), limits=Limits(4, 16), slots=4, n_ctx=128) as ring:
            runner = RingRunner(ring.bridge, model_path, n_ctx=128)
            gateway.state.add_job("j1", kind="completion", max_tokens=8, temperature=0.0)
            assert _loop(api, runner, tmp_path).run(max_jobs=1) == 1
            gateway.state.add_job("shaped", kind="completion", max_tokens=8, response_format={"type": "json_object"})
            assert _loop(api, runner, tmp_path).run(max_jobs=1) == 1
            gateway.state.add_job("resumed", kind="completion", max_tokens=8, response_format={"type": "json_object"})
            with gateway.state.cond:  # a continuation under the grammar: the delivered text to write again first
                gateway.state.queue[-1].update(continuation=True, rewrite='{"a": ')
            assert _loop(api, runner, tmp_path).run(max_jobs=1) == 1
            prompt = runner._vocab.tokenize(b"Once upon", add_bos=True, special=True)
            ring.agents[1].close()  # the tail dies
            gateway.state.add_job("j2", kind="completion", max_tokens=8, temperature=0.0)
            assert _loop(api, runner, tmp_path).run(max_jobs=1) == 1
        assert gateway.state.status["j1"] == "completed"
        assert gateway.state.completions["j1"]["completion_tokens"] == 8
        (full,) = build_stages(model_path, [(0, 18)], n_rows=1, n_ctx=64)
        want = generate([full], prompt, 8).token_ids
        assert gateway.state.text["j1"] == runner._decode(want)
        assert gateway.state.completions["j1"]["tokens"] == want  # reported for its audit
        assert gateway.state.status["shaped"] == "completed" and gateway.state.text["shaped"].startswith("{")
        assert gateway.state.status["resumed"] == "completed"  # (mahout 0.7.0: the ring writes the rewrite again first)
        assert not gateway.state.text["resumed"].startswith('{"a": ')  # the customer has that text already
        assert gateway.state.status["j2"] == "failed"
        assert "ring" in gateway.state.failures["j2"]

    def test_parallel_loops_keep_several_jobs_in_flight_in_one_ring(
        self, model_path: Path, gateway: FakeGateway, api: HostApi, tmp_path: Path
    ) -> None:
        with ThreadRing(model_path, split_layers(18, 2), limits=Limits(4, 16), slots=4, n_ctx=128) as ring:
            head = ring.agents[0]
            head.trace = []
            for i in range(3):
                gateway.state.add_job(f"p{i}", kind="completion", max_tokens=12, temperature=0.0)
            loops = ring_loops(
                api,
                ring.bridge,
                model_path,
                parallel=3,
                n_ctx=128,
                fingerprint="f" * 64,
                home=tmp_path,
                out=lambda _line: None,
                claim_wait=0.2,
                heartbeat_interval=0.05,
            )
            assert run_loops(loops, max_jobs=3) == 3
        assert [gateway.state.status[f"p{i}"] for i in range(3)] == ["completed"] * 3
        assert len({gateway.state.text[f"p{i}"] for i in range(3)}) == 1  # the same prompt, the same greedy text
        assert max(len(rows) for rows in head.trace) >= 2, "the jobs never shared a pass"
