"""The coordinator's host side without a gateway: its qualification benchmark, and the slot
loops' catalog (how many jobs the gateway may offer it at once)."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine.moe_loader import make_tiny_moe
from mahout.moe.runner import MoeRunner
from mahout.moe.serve import MoeHostLoop, measure_moe


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_moe(tmp_path_factory.mktemp("moe") / "tiny-moe.gguf", seed=2)


class MeasureMoeTests:
    def test_it_gives_the_figures_a_qualification_needs(self, tiny: Path) -> None:
        result = measure_moe(tiny, 1, progress=False)
        assert set(result) >= {"prompt_tps", "gen_tps", "ttft_ms", "memory_mb", "threads"}
        assert result["gen_tps"] > 0 and result["prompt_tps"] > 0 and result["threads"] == 1


class MoeHostLoopTests:
    def test_its_catalog_carries_the_runner_slots_and_busy_count(self, tiny: Path, tmp_path: Path) -> None:
        runner = MoeRunner(tiny, n_slots=3)
        try:
            loop = MoeHostLoop(object(), {"tiny-moe": runner.slot()}, fingerprint="f" * 64, home=tmp_path,  # type: ignore[arg-type]
                               installed=["tiny-moe"], slots=3, busy=runner.busy_slots, out=lambda _line: None)
            stream = runner.generate_stream([1, 2, 3], 4)
            next(stream)  # one request holds a slot
            catalog = loop.catalog()
            assert (catalog["slots"], catalog["active_jobs"], catalog["loaded"]) == (3, 1, ["tiny-moe"])
            stream.close()
            assert loop.catalog()["active_jobs"] == 0
        finally:
            runner.close()
