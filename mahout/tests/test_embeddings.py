"""The real embeddings model: the shipped all-MiniLM-L6-v2 through EmbeddingsRunner, on CPU.

One model load per module (1 thread); a few short sentences, so it runs in seconds.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from typing import TYPE_CHECKING

import pytest

from mahout import benchmark
from mahout.loop import HostLoop
from mahout.runners.embeddings import DIMENSIONS, MODEL_NAME, EmbeddingsRunner, model_dir

if TYPE_CHECKING:
    from mahout.tests.fake_farm import FarmGateway


@pytest.fixture(scope="module")
def runner() -> EmbeddingsRunner:
    return EmbeddingsRunner(threads=1)


@pytest.fixture
def gateway(farm: FarmGateway) -> FarmGateway:
    return farm  # conftest's `api` talks to the farm


def dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


class EmbeddingsRunnerTests:
    def test_it_gives_one_unit_vector_of_384_floats_per_input_in_order(self, runner):
        texts = ["The cat sleeps on the sofa.", "Stock markets fell sharply today.", "The cat sleeps on the sofa."]
        vectors = runner.embed(texts)
        assert len(vectors) == 3 and DIMENSIONS == 384
        for vector in vectors:
            assert len(vector) == 384 and all(type(x) is float for x in vector)
            assert math.isclose(math.sqrt(dot(vector, vector)), 1.0, abs_tol=1e-5)
        assert vectors[0] == vectors[2]

    def test_it_puts_similar_sentences_closer_than_unrelated_ones(self, runner):
        cat, kitten, markets = runner.embed(
            ["A cat is sleeping on the couch.", "A kitten naps on the sofa.", "Interest rates rose by half a percent."]
        )
        assert dot(cat, kitten) > dot(cat, markets) + 0.3

    def test_it_counts_the_input_tokens_it_embedded(self, runner):
        runner.embed(["hello world", "a cat sat on the mat"])
        assert runner.prompt_tokens == 2 + 6 == runner.count_tokens(["hello world", "a cat sat on the mat"])
        assert runner.count_tokens(["word " * 1000]) == runner.max_tokens - 2  # truncated to the window
        assert runner.embed([]) == [] and runner.prompt_tokens == 0

    def test_jobs_at_once_share_forward_passes_and_each_gets_its_own_vectors_and_count(self, runner, monkeypatch):
        jobs = [
            ["The cat sleeps on the sofa.", "A dog barks."],
            ["Stock markets fell sharply today."],
            ["Rain is expected tomorrow.", "The river is low.", "Elephants remember."],
        ]
        alone = [(runner.embed(texts), runner.count_tokens(texts)) for texts in jobs]
        passes: list[int] = []
        first_pass = threading.Event()
        real_embed = runner.embed

        def embed(texts: list[str]) -> list[list[float]]:
            passes.append(len(texts))
            if len(passes) == 1:
                first_pass.wait(5)  # the other jobs arrive while the first pass runs
            return real_embed(texts)

        monkeypatch.setattr(runner, "embed", embed)
        results: dict[int, tuple[list[list[float]], int]] = {}
        threads = [
            threading.Thread(target=lambda i=i: results.__setitem__(i, runner.embed_job(jobs[i]))) for i in range(3)
        ]
        threads[0].start()
        while not passes:
            time.sleep(0.001)
        for thread in threads[1:]:
            thread.start()
        time.sleep(0.2)
        first_pass.set()
        for thread in threads:
            thread.join(30)
        assert passes == [2, 4], "the two jobs that waited shared one pass"
        for index, (vectors, tokens) in enumerate(alone):
            got, counted = results[index]
            assert counted == tokens and len(got) == len(vectors)
            assert all(dot(a, b) > 0.9999 for a, b in zip(got, vectors, strict=True)), "the same vectors as alone"

    def test_it_loads_from_the_package_without_the_network(self, monkeypatch):
        def refuse(*_args: object) -> None:
            raise AssertionError("the embeddings model tried to reach the network")

        monkeypatch.setattr(socket.socket, "connect", refuse)
        assert len(EmbeddingsRunner(model_dir(), threads=1).embed(["offline"])[0]) == DIMENSIONS

    def test_it_completes_an_embeddings_job_through_the_host_loop(self, runner, farm, api, tmp_path):
        texts = ["first input", "second input"]
        farm.add_embeddings_job("job-1", texts)
        loop = HostLoop(
            api,
            {MODEL_NAME: runner},
            fingerprint="f" * 64,
            home=tmp_path,
            claim_wait=0.2,
            heartbeat_interval=0.05,
            out=lambda _line: None,
        )
        assert loop.run(max_jobs=1) == 1
        sent = farm.state.completions["job-1"]
        assert sent["finish_reason"] == "stop" and sent["embeddings"] == runner.embed(texts)
        assert farm.state.pushes == []


class EmbeddingsBenchmarkTests:
    def test_it_measures_a_qualification_the_gateway_accepts(self, monkeypatch):
        monkeypatch.setattr(benchmark, "EMBED_INPUTS", 16)
        result = benchmark.run_embeddings_benchmark(model_dir(), 1, progress=False)
        assert result["gen_tps"] == result["prompt_tps"] > 0
        assert result["ttft_ms"] > 0 and result["memory_mb"] >= 0 and result["threads"] == 1
        assert result["inputs_per_s"] > 0
