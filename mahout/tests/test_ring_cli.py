"""`python -m mahout ring`: real stage processes on loopback print the engine's greedy text."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mahout.__main__ import main

ROOT = Path(__file__).resolve().parents[2]
# engine.generate's greedy tokens for "The capital of France is" (see engine/tests/test_generate.py)
ENGINE_TOKENS = [506, 5279, 529, 506, 2891, 529, 7001, 236761]


class RingCommandTests:
    def test_it_refuses_a_one_stage_pipeline(self, capsys) -> None:  # type: ignore[no-untyped-def]
        assert main(["ring", "--stages", "1", "--prompt", "hi"]) == 2
        assert "a pipeline needs at least two stages" in capsys.readouterr().err

    def test_it_prints_the_engines_greedy_text_from_stage_processes(self) -> None:
        from engine.gguf_loader import default_model_path
        from engine.tokenizer import Tokenizer

        done = subprocess.run(
            [sys.executable, "-m", "mahout", "ring", "--stages", "2", "--prompt", "The capital of France is",
             "--max-tokens", str(len(ENGINE_TOKENS)), "--n-ctx", "64"],
            cwd=ROOT, capture_output=True, text=True, timeout=240,
        )
        assert done.returncode == 0, done.stderr
        expected = Tokenizer(default_model_path()).decode(ENGINE_TOKENS)
        assert done.stdout.strip() == expected.strip()
        assert "ring of 2 stages [(0, 9), (9, 18)]" in done.stderr
        assert "stage 1 layers [9, 18): held" in done.stderr

    def test_it_serves_a_gateway_job_as_one_host(self, tmp_path: Path) -> None:
        from mahout.tests.fake_gateway import TOKEN, FakeGateway

        with FakeGateway() as gateway:
            gateway.state.add_job("j1", kind="completion", max_tokens=6, temperature=0.0)
            done = subprocess.run(
                [sys.executable, "-m", "mahout", "ring", "--stages", "2", "--server", gateway.url, "--token", TOKEN,
                 "--max-jobs", "1", "--parallel", "1", "--home", str(tmp_path), "--n-ctx", "128"],
                cwd=ROOT, capture_output=True, text=True, timeout=240,
            )
        assert done.returncode == 0, done.stderr + done.stdout
        (qualification,) = gateway.state.qualifications
        assert qualification["model"] == "gemma-3-270m" and qualification["benchmark"]["gen_tps"] > 0
        assert qualification["benchmark"]["threads"] == 2
        assert gateway.state.status["j1"] == "completed"
        assert gateway.state.completions["j1"]["completion_tokens"] == 6
        assert "serving gemma-3-270m from a ring of 2 stages" in done.stdout and "(1 job(s) at once)" in done.stdout
