"""A trusted host scoring an audit (mahout/scoring.py) with the model its runner loaded: the
verdict, and the runner serving exactly as before afterwards (its prefix cache reset)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from mahout.loop import HostLoop
from mahout.runners.llama import LlamaRunner
from mahout.scoring import audit_score
from protocol.jobs import AUDIT
from testkit.formats import rendered

MODEL = "gemma-3-270m"


@pytest.fixture(scope="module")
def runner(model_path: Path) -> Iterator[LlamaRunner]:
    runner = LlamaRunner(model_path, threads=1, n_ctx=1024)
    yield runner
    runner.close()


def chat(text: str, *, seed: int) -> dict:
    return rendered(
        {
            "id": 1,
            "model": MODEL,
            "kind": "chat",
            "prompt": None,
            "messages": [{"role": "user", "content": text}],
            "params": {"max_tokens": 24, "temperature": 0.9, "top_p": 1.0, "stop": None, "seed": seed},
        }
    )


def served(runner: LlamaRunner, job: dict) -> dict:
    """An audit of `job` as the gateway hands it to a scorer, after `runner` answered it."""
    text = "".join(runner.stream(job))
    return {
        "id": 41,
        "model": MODEL,
        "kind": AUDIT,
        "job": {k: v for k, v in job.items() if k != "id"},
        "tokens": list(runner.token_ids),
        "text": text,
        "finish_reason": runner.finish_reason,
        "seed": runner.seed,
    }


class StubApi:
    def __init__(self) -> None:
        self.verdicts: list[tuple[object, dict]] = []

    def audit_verdict(self, audit_id: object, verdict: dict) -> dict:
        self.verdicts.append((audit_id, verdict))
        return {"status": verdict["verdict"]}


def test_an_honest_answer_passes_a_made_up_one_fails_and_the_runner_serves_as_before(runner: LlamaRunner) -> None:
    first, other = chat("Name three large animals.", seed=11), chat("Write one line about rivers.", seed=12)
    audit = served(runner, other)
    before = served(runner, first)  # the runner's cache now holds this job's prompt and answer
    verdict = audit_score(audit, runner)  # reads the other answer over the same model: its KV memory is rewritten
    assert verdict["verdict"] == "passed" and verdict["checked"] == len(audit["tokens"]) > 0 and verdict["misses"] == 0
    drawn = audit_score({**audit, "draw": 3}, runner)  # the gateway names how many tokens to draw
    assert drawn["verdict"] == "passed" and drawn["checked"] == 3 < len(audit["tokens"])
    assert served(runner, first)["tokens"] == before["tokens"]  # the prefix cache was reset, not trusted
    forged = {
        **audit,
        "tokens": [*before["tokens"]],
        "text": before["text"],
    }  # another job's answer, passed off as this one's
    failed = audit_score(forged, runner)
    assert failed["verdict"] == "failed" and failed["reason"]


def test_the_loop_reports_a_verdict_and_declines_what_it_cannot_read(runner: LlamaRunner, tmp_path: Path) -> None:
    api, lines = StubApi(), []
    loop = HostLoop(api, {MODEL: runner}, fingerprint="f" * 64, home=tmp_path, out=lines.append)  # type: ignore[arg-type]
    loop._handle(served(runner, chat("Count from one to five.", seed=3)))
    assert api.verdicts[-1][0] == 41 and api.verdicts[-1][1]["verdict"] == "passed"
    assert any(line.startswith("mahout: scored audit 41: passed") for line in lines)
    loop._handle({"id": 42, "model": "not-here", "kind": AUDIT, "job": {}, "tokens": [], "text": "", "seed": 1})
    assert api.verdicts[-1][0] == 42 and api.verdicts[-1][1]["verdict"] == "declined"
    assert audit_score({"id": 43, "job": None}, runner)["verdict"] == "declined"  # no job to read
    assert audit_score({"id": 44}, object())["reason"].startswith("this host's runner")  # not one llama.cpp model
