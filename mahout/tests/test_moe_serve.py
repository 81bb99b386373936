"""The coordinator's host side without a gateway: its qualification benchmark, and the slot
loops' catalog (how many jobs the gateway may offer it at once)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.moe_loader import make_tiny_moe
from mahout.moe.runner import MoeRunner
from mahout.moe.serve import MoeHostLoop, measure_moe
from scorer.errors import RequestRejected


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
            loop = MoeHostLoop(
                object(),
                {"tiny-moe": runner.slot()},
                fingerprint="f" * 64,
                home=tmp_path,  # type: ignore[arg-type]
                installed=["tiny-moe"],
                slots=3,
                busy=runner.busy_slots,
                out=lambda _line: None,
            )
            stream = runner.generate_stream([1, 2, 3], 4)
            next(stream)  # one request holds a slot
            catalog = loop.catalog()
            assert (catalog["slots"], catalog["active_jobs"], catalog["loaded"]) == (3, 1, ["tiny-moe"])
            stream.close()
            assert loop.catalog()["active_jobs"] == 0
        finally:
            runner.close()


class PackedStepsTests:
    """Decode steps of concurrent requests run as the rows of one pass (seed 004)."""

    def test_concurrent_requests_share_passes_and_answer_as_each_would_alone(self, tiny: Path) -> None:
        import threading

        from engine.moe import MoeModel
        from engine.moe_loader import load_moe

        prompts = [[1, 2, 3], [40, 41], [7, 8, 9, 10], [100]]
        config, weights = load_moe(tiny)
        alone = {i: MoeModel(config, weights, n_rows=1).generate(p, 24) for i, p in enumerate(prompts)}
        runner = MoeRunner(tiny, n_slots=4)
        got: dict[int, list[int]] = {}
        start = threading.Barrier(len(prompts))

        def serve(i: int) -> None:
            start.wait()
            got[i] = runner.generate(prompts[i], 24)

        try:
            threads = [threading.Thread(target=serve, args=(i,)) for i in range(len(prompts))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=60)
            assert got == alone
            assert runner.rows == sum(len(tokens) - 1 for tokens in got.values()), "every decode step ran once"
            assert runner.rows > runner.passes, f"{runner.rows} rows in {runner.passes} passes: nothing was packed"
        finally:
            runner.close()

    def test_a_pass_that_fails_raises_in_its_request_and_frees_the_slot(self, tiny: Path) -> None:
        runner = MoeRunner(tiny, n_slots=2)
        try:
            stream = runner.generate_stream([1, 2, 3], 8)
            next(stream)

            def broken(layer: int, inputs: dict) -> dict:
                raise RuntimeError("a worker vanished mid-pass")

            runner.model.experts = broken
            with pytest.raises(RuntimeError, match="vanished"):
                next(stream)
            assert runner.busy_slots() == 0 and runner._pending == []
        finally:
            runner.close()


class ContextCapTests:
    """`mahout moe coordinator --ctx N`: the KV cache holds N tokens per slot, not the file's
    whole context (Qwen3-30B-A3B's 40,960 would take ~30 GiB in float32 for four slots)."""

    def test_a_capped_context_sizes_the_cache_and_refuses_a_longer_prompt_with_the_reason(self, tiny: Path) -> None:
        whole, capped = MoeRunner(tiny, n_slots=2), MoeRunner(tiny, n_slots=2, n_ctx=48)
        try:
            assert capped.model.cache.n_ctx == 48 < whole.model.cache.n_ctx
            assert capped.kv_cache_mib() == pytest.approx(whole.kv_cache_mib() * 48 / whole.model.cache.n_ctx)
            slot = capped.slot()
            long = {
                "kind": "completion",
                "fragments": [["x" * 60, False]],
                "params": {"max_tokens": 8, "temperature": 0},
            }
            with pytest.raises(RequestRejected, match="prompt is 61 tokens; the context window is 48 tokens"):
                list(slot.stream(long))
            assert capped.busy_slots() == 0
            short = {
                "kind": "completion",
                "fragments": [["elephants ", False]],
                "params": {"max_tokens": 100, "temperature": 0},
            }
            "".join(slot.stream(short))
            assert 0 < slot.completion_tokens <= 48 - 11  # what the context leaves after the prompt (and its BOS)
        finally:
            whole.close()
            capped.close()

    def test_a_cap_outside_the_files_context_is_refused(self, tiny: Path) -> None:
        with pytest.raises(ValueError, match="not in 1..256"):
            MoeRunner(tiny, n_slots=1, n_ctx=10_000)

    def test_the_cli_refuses_a_cap_past_the_files_context_in_one_line(
        self, tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture
    ) -> None:
        from mahout.__main__ import main

        for ctx, says in (
            ("10000", "--ctx 10000 is past tiny-moe.gguf's context length (256)"),
            ("0", "--ctx 0: a context holds at least one token"),
        ):
            assert (
                main(
                    [
                        "moe",
                        "coordinator",
                        "--server",
                        "http://127.0.0.1:9",
                        "--token",
                        "t",
                        "--model",
                        str(tiny),
                        "--name",
                        "m",
                        "--home",
                        str(tmp_path),
                        "--ctx",
                        ctx,
                    ]
                )
                == 2
            )
            assert says in capsys.readouterr().err
