"""The qualification cache: restarts reuse a benchmark for the same model, machine and file."""

from __future__ import annotations

from mahout import benchmark

RESULT = {"prompt_tps": 500.0, "gen_tps": 45.0, "ttft_ms": 400.0, "memory_mb": 300.0, "threads": 2}


class QualifyTests:
    def test_it_measures_once_then_reuses_the_cache(self, tmp_path, monkeypatch):
        runs = []
        monkeypatch.setattr(benchmark, "run_benchmark", lambda path, threads, progress: runs.append(threads) or RESULT)
        first = benchmark.qualify(tmp_path, "m", tmp_path / "m.gguf", "sha", "fp", 2, progress=False)
        second = benchmark.qualify(tmp_path, "m", tmp_path / "m.gguf", "sha", "fp", 2, progress=False)
        assert first == (RESULT, False) and second == (RESULT, True) and runs == [2]

    def test_it_measures_again_for_another_file_machine_thread_count_or_on_request(self, tmp_path, monkeypatch):
        runs = []
        monkeypatch.setattr(
            benchmark,
            "run_benchmark",
            lambda path, threads, progress: runs.append(threads) or {**RESULT, "threads": threads},
        )
        benchmark.qualify(tmp_path, "m", tmp_path, "sha", "fp", 2, progress=False)
        benchmark.qualify(tmp_path, "m", tmp_path, "sha2", "fp", 2, progress=False)
        benchmark.qualify(tmp_path, "m", tmp_path, "sha", "fp2", 2, progress=False)
        benchmark.qualify(tmp_path, "m", tmp_path, "sha", "fp", 1, progress=False)
        benchmark.qualify(tmp_path, "m", tmp_path, "sha", "fp", 1, rebenchmark=True, progress=False)
        assert runs == [2, 2, 2, 1, 1]

    def test_it_reads_resident_memory(self):
        assert benchmark.rss_mb() > 1
