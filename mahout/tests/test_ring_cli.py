"""`python -m mahout ring`: real stage processes on loopback print the engine's greedy text;
with ``--server`` they find each other through the control plane and serve gateway jobs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mahout.__main__ import main
from mahout.tests.fake_gateway import FakeGateway

if TYPE_CHECKING:
    from collections.abc import Callable

    import pytest

ROOT = Path(__file__).resolve().parents[2]
# engine.generate's greedy tokens for "The capital of France is" (see engine/tests/test_generate.py)
ENGINE_TOKENS = [506, 5279, 529, 506, 2891, 529, 7001, 236761]


class RingCommandTests:
    def test_it_refuses_a_one_stage_pipeline(self, capsys: pytest.CaptureFixture[str]) -> None:
        assert main(["ring", "--stages", "1", "--prompt", "hi"]) == 2
        assert "a pipeline needs at least two stages" in capsys.readouterr().err

    def test_a_stage_refuses_no_memory_for_its_evidence(self, capsys: pytest.CaptureFixture[str]) -> None:
        assert (
            main(
                [
                    "stage",
                    "--server",
                    "http://127.0.0.1:9",
                    "--token",
                    "t",
                    "--ring",
                    "1",
                    "--stage",
                    "0",
                    "--evidence-mb",
                    "0",
                ]
            )
            == 2
        )
        assert "--evidence-mb must be at least 1, not 0" in capsys.readouterr().out

    def test_it_prints_the_engines_greedy_text_from_stage_processes(self) -> None:
        from engine.gguf_loader import default_model_path
        from engine.tokenizer import Tokenizer

        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "mahout",
                "ring",
                "--stages",
                "2",
                "--prompt",
                "The capital of France is",
                "--max-tokens",
                str(len(ENGINE_TOKENS)),
                "--n-ctx",
                "64",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert done.returncode == 0, done.stderr
        expected = Tokenizer(default_model_path()).decode(ENGINE_TOKENS)
        assert done.stdout.strip() == expected.strip()
        assert "ring of 2 stages [(0, 9), (9, 18)]" in done.stderr
        assert "stage 1 layers [9, 18): held" in done.stderr

    def test_it_serves_gateway_jobs_from_its_own_ring_and_heals_it_after_a_stage_dies(self, tmp_path: Path) -> None:
        from mahout.tests.fake_gateway import TOKEN

        with RingGateway() as gateway:
            gateway.state.add_job("j1", kind="completion", max_tokens=6, temperature=0.0)
            ring = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "mahout",
                    "ring",
                    "--stages",
                    "2",
                    "--server",
                    gateway.url,
                    "--token",
                    TOKEN,
                    "--max-jobs",
                    "2",
                    "--parallel",
                    "1",
                    "--home",
                    str(tmp_path),
                    "--n-ctx",
                    "128",
                    "--bench-tokens",
                    "4",
                    "--wait",
                    "60",
                ],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            try:
                _wait(lambda: gateway.state.status.get("j1") == "completed", ring, "job 1")
                os.kill(_children(ring.pid)[-1], signal.SIGKILL)  # kill -9 the tail's stage process
                time.sleep(2)  # the bridge has stopped claiming: job 2 waits for the ring to heal
                gateway.state.add_job("j2", kind="completion", max_tokens=6, temperature=0.0)
                output, _ = ring.communicate(timeout=180)
            finally:
                if ring.poll() is None:
                    ring.kill()
                    ring.wait()
        assert ring.returncode == 0, output
        (qualification,) = gateway.state.qualifications
        assert qualification["model"] == "gemma-3-270m" and qualification["benchmark"]["threads"] == 2
        assert [gateway.state.status[j] for j in ("j1", "j2")] == ["completed", "completed"]
        assert gateway.state.completions["j2"]["completion_tokens"] == 6
        assert gateway.state.text["j1"] == gateway.state.text["j2"], "greedy: the healed ring gives the same text"
        assert [s["stage"] for s in gateway.ring_reports[-1]] == [0, 1]
        assert "local stage 1 exited with code -9; restarting it" in output
        assert "serving gemma-3-270m from ring 1 (2 stages)" in output and "(1 job(s) at once)" in output
        assert all(address.startswith("127.0.0.1:") for address in gateway.addresses.values())


def _wait(done: Callable[[], bool], process: subprocess.Popen, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert process.poll() is None, process.stdout.read() if process.stdout else ""
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _children(pid: int) -> list[int]:
    return sorted(int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split())


class RingGateway(FakeGateway):
    """The fake gateway plus the ring API a host's own ring needs: propose, assignment (with
    each stage's links' secrets), the bridge's links' secrets, addresses (reported, read and
    left) and stats reports, for one ring (id 1) of two stages, all on this host."""

    def __init__(self) -> None:
        from mahout.ring.keys import ring_keys

        super().__init__()
        self.keys = ring_keys(2)
        self.model = "gemma-3-270m"  # the plan's model
        self.n_stages = 0
        self.addresses: dict[int, str] = {}
        self.left: list[tuple[int, str]] = []  # (stage, address) each leave cleared
        self.ring_reports: list[list[dict]] = []
        self._server.RequestHandlerClass = _ring_handler(self)

    def stages(self) -> list[dict]:
        ranges = [(0, 9), (9, 18)] if self.n_stages == 2 else []
        return [
            {"stage": i, "start": a, "end": b, "host": 1, "address": self.addresses.get(i, "")}
            for i, (a, b) in enumerate(ranges)
        ]


def _links(keys: Any) -> dict:  # noqa: ANN401 - a StageKeys, as the gateway's assignment carries it
    return {
        "upstream": {"stage": keys.upstream_index, "secret": keys.upstream},
        "downstream": {"stage": keys.downstream_index, "secret": keys.downstream},
        "bridge": keys.bridge,
    }


def _ring_handler(gateway: RingGateway) -> type:
    from mahout.tests.fake_gateway import _Handler

    class Handler(_Handler):
        def do_GET(self) -> None:
            if self.path == "/api/rings/assignment" and self._authorized():
                plan = {
                    "ring": 1,
                    "model": gateway.model,
                    "row_width": 64,
                    "micro_batch": 4,
                    "n_layers": 18,
                    "stages": gateway.stages(),
                }
                self._send(
                    200,
                    {
                        "assignments": [
                            {**plan, **s, "links": _links(gateway.keys[s["stage"]])} for s in gateway.stages()
                        ]
                    },
                )
            elif self.path == "/api/rings/1/addresses" and self._authorized():
                self._send(200, {"ring": 1, "stages": gateway.stages()})
            elif self.path == "/api/rings/1/secret" and self._authorized():
                self._send(200, {"ring": 1, "head": gateway.keys.bridge.head, "tail": gateway.keys.bridge.tail})
            else:
                super().do_GET()

        def do_POST(self) -> None:
            if not self.path.startswith("/api/rings/"):
                super().do_POST()
                return
            if not self._authorized():
                return
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            parts = self.path.removeprefix("/api/rings/").split("/")
            if parts == ["own"]:
                gateway.n_stages = body["stages"]
                self._send(201, {"ring": 1, "stages": gateway.stages()})
            elif parts[:2] == ["1", "stages"] and parts[3:] == ["address"]:
                gateway.addresses[int(parts[2])] = body["address"]
                self._send(200, {"stage": int(parts[2]), "address": body["address"]})
            elif parts[:2] == ["1", "stages"] and parts[3:] == ["leave"]:
                cleared = gateway.addresses.get(int(parts[2])) == body["address"]
                if cleared:
                    gateway.addresses.pop(int(parts[2]))
                    gateway.left.append((int(parts[2]), body["address"]))
                self._send(200, {"cleared": cleared})
            elif parts == ["1", "stats"]:
                gateway.ring_reports.append(body["stages"])
                self._send(200, {"updated": len(body["stages"])})
            else:
                self._error(404, "not found", "not_found")

    return Handler
