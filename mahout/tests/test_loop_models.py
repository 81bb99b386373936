"""Several models on one host: the heartbeat's catalog, embeddings jobs, cold loads in the loop.

Real HTTP against the fake gateway (extended with embeddings jobs); fake runners.
"""

from __future__ import annotations

import time
from collections.abc import Generator

import pytest

from mahout.api import HostApi
from mahout.loader import ModelLoader
from mahout.loop import HostLoop
from mahout.tests.fake_farm import FarmGateway

CHAT, EMBED = "gemma-3-270m", "all-minilm-l6-v2"


class FakeChat:
    def __init__(self, delay: float = 0.0) -> None:
        self.delay, self.finish_reason, self.completion_tokens = delay, "stop", 0
        self.closed = False

    def stream(self, job: dict) -> Generator[str, None, None]:
        for piece in ("one ", "two"):
            time.sleep(self.delay)
            yield piece
        self.completion_tokens = 2

    def close(self) -> None:
        self.closed = True


class FakeEmbedder:
    """Vectors that encode the input's length, so order is checkable."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error, self.prompt_tokens, self.closed = error, 0, False

    def embed(self, texts: list[str]) -> list[list[float]]:
        if self.error is not None:
            raise self.error
        self.prompt_tokens = sum(len(text.split()) for text in texts)
        return [[float(len(text)), 0.5, -0.25] for text in texts]

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def gateway(farm: FarmGateway) -> FarmGateway:
    return farm  # conftest's `api` talks to the farm


def make_loop(api: HostApi, models: ModelLoader | dict, home, lines: list[str] | None = None, **options) -> HostLoop:
    return HostLoop(
        api,
        models,
        fingerprint="f" * 64,
        home=home,
        claim_wait=0.2,
        heartbeat_interval=0.02,
        pause_poll=0.01,
        error_backoff=0.01,
        out=(lines if lines is not None else []).append,
        **options,
    )


def one_model_budget(runners: dict[str, object], loads: list[str]) -> ModelLoader:
    """A loader with room for one of CHAT (300 MB) and EMBED (200 MB) at a time."""

    def load(name: str) -> object:
        loads.append(name)
        return runners[name]

    return ModelLoader(load, {CHAT: 300.0, EMBED: 200.0}, 400, out=lambda _line: None)


class HeartbeatCatalogTests:
    def test_it_sends_installed_qualified_loaded_slots_active_jobs_and_budget(self, farm, api, tmp_path):
        models = one_model_budget({CHAT: FakeChat(), EMBED: FakeEmbedder()}, [])
        models.preload([CHAT, EMBED])
        loop = make_loop(api, models, tmp_path, installed=[EMBED, CHAT, "other-model"])
        loop.heartbeat()
        beat = farm.state.heartbeats[-1]
        assert beat["catalog"] == {
            "installed": sorted([EMBED, CHAT, "other-model"]),
            "qualified": sorted([CHAT, EMBED]),
            "loaded": [CHAT],
            "slots": 1,
            "active_jobs": 0,
            "memory_budget_mb": 400,
        }
        assert beat["models_loaded"] == [CHAT]
        assert {"fingerprint", "paused", "version", "active_jobs"} <= set(beat)

    def test_it_counts_the_running_job_and_reports_what_became_warm(self, farm, api, tmp_path):
        models = one_model_budget({CHAT: FakeChat(delay=0.05), EMBED: FakeEmbedder()}, [])
        farm.state.add_job("job-1")
        make_loop(api, models, tmp_path).run(max_jobs=1)
        catalogs = [beat["catalog"] for beat in farm.state.heartbeats]
        assert catalogs[0]["loaded"] == [] and catalogs[0]["active_jobs"] == 0
        assert any(c["active_jobs"] == 1 and c["loaded"] == [CHAT] for c in catalogs)

    def test_a_loop_over_fixed_runners_reports_them_loaded(self, farm, api, tmp_path):
        make_loop(api, {CHAT: FakeChat()}, tmp_path).heartbeat()
        catalog = farm.state.heartbeats[-1]["catalog"]
        assert catalog["installed"] == catalog["qualified"] == catalog["loaded"] == [CHAT]
        assert catalog["memory_budget_mb"] == 0


class EmbeddingsJobTests:
    def test_it_completes_with_one_vector_per_input_in_order_and_pushes_no_tokens(self, farm, api, tmp_path):
        lines: list[str] = []
        farm.add_embeddings_job("job-1", ["a", "bbb", "cc"])
        assert make_loop(api, {EMBED: FakeEmbedder()}, tmp_path, lines).run(max_jobs=1) == 1
        assert farm.state.completions["job-1"] == {
            "finish_reason": "stop",
            "embeddings": [[1.0, 0.5, -0.25], [3.0, 0.5, -0.25], [2.0, 0.5, -0.25]],
            "earned_ucents": 24,
        }
        assert farm.state.pushes == []
        assert any(line.startswith("mahout: completed job-1: 3 vector(s), 3 tokens in") for line in lines)

    def test_it_reports_a_runner_error_through_the_fail_endpoint(self, farm, api, tmp_path):
        farm.add_embeddings_job("job-1", ["a"])
        make_loop(api, {EMBED: FakeEmbedder(error=RuntimeError("out of memory"))}, tmp_path).run(max_jobs=1)
        assert farm.state.failures["job-1"] == "RuntimeError: out of memory"
        assert "job-1" not in farm.state.completions

    def test_it_fails_a_job_whose_input_is_not_a_list_of_strings(self, farm, api, tmp_path):
        farm.add_embeddings_job("job-1", ["a"])
        farm.state.queue[-1]["input"] = "a"
        make_loop(api, {EMBED: FakeEmbedder()}, tmp_path).run(max_jobs=1)
        assert farm.state.failures["job-1"] == "ValueError: an embeddings job's input must be a list of strings"

    def test_it_fails_a_job_of_the_wrong_kind_for_the_model(self, farm, api, tmp_path):
        farm.add_embeddings_job("job-1", ["a"], model=CHAT)
        farm.state.add_job("job-2", model=EMBED)
        make_loop(api, {CHAT: FakeChat(), EMBED: FakeEmbedder()}, tmp_path).run(max_jobs=2)
        assert farm.state.failures == {
            "job-1": f"model {CHAT!r} does not compute embeddings",
            "job-2": f"model {EMBED!r} does not generate text",
        }


class ColdLoadTests:
    def test_it_loads_a_cold_model_for_a_claimed_job_and_unloads_the_least_recently_used(self, farm, api, tmp_path):
        chat, embedder, loads = FakeChat(), FakeEmbedder(), []
        models = one_model_budget({CHAT: chat, EMBED: embedder}, loads)
        models.preload([CHAT])
        farm.add_embeddings_job("job-1", ["x"])
        farm.state.add_job("job-2")
        loop = make_loop(api, models, tmp_path)
        assert loop.run(max_jobs=2) == 2
        assert set(farm.state.completions) == {"job-1", "job-2"}
        assert loads == [CHAT, EMBED, CHAT] and embedder.closed and chat.closed
        loop.heartbeat()
        assert farm.state.heartbeats[-1]["catalog"]["loaded"] == [CHAT]

    def test_it_fails_the_job_when_the_model_cannot_be_loaded(self, farm, api, tmp_path):
        def broken(name: str) -> object:
            raise OSError("weights missing")

        farm.add_embeddings_job("job-1", ["x"])
        make_loop(api, ModelLoader(broken, {EMBED: 200.0}, 400, out=lambda _l: None), tmp_path).run(max_jobs=1)
        assert farm.state.failures["job-1"] == f"could not load {EMBED}: OSError: weights missing"


class RedundancyAskTests:
    """The gateway's heartbeat answer asks an idle host to keep a model warm, or to let it go."""

    def test_a_load_ask_loads_the_model_in_the_background_and_the_next_heartbeat_reports_it(self, farm, api, tmp_path):
        loads, lines = [], []
        models = one_model_budget({CHAT: FakeChat(), EMBED: FakeEmbedder()}, loads)
        loop = make_loop(api, models, tmp_path, lines)
        farm.state.asks = {"load": [CHAT, "not-qualified-here"], "unload": []}
        loop.heartbeat()
        deadline = time.monotonic() + 5
        while CHAT not in models.loaded() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loads == [CHAT], "only a model this host qualified is loaded, once"
        farm.state.asks = {"load": [CHAT], "unload": []}
        loop.heartbeat()
        assert farm.state.heartbeats[-1]["catalog"]["loaded"] == [CHAT] and loads == [CHAT], (
            "an ask already met loads nothing"
        )
        assert any("keep it warm" in line for line in lines)

    def test_an_unload_ask_frees_an_idle_model_but_never_one_serving_a_job(self, farm, api, tmp_path):
        chat = FakeChat()
        models = one_model_budget({CHAT: chat, EMBED: FakeEmbedder()}, [])
        models.preload([CHAT])
        loop = make_loop(api, models, tmp_path)
        farm.state.asks = {"load": [], "unload": [CHAT]}
        with models.acquire(CHAT):  # a job is using it
            loop.heartbeat()
            assert models.loaded() == [CHAT] and not chat.closed
        loop.heartbeat()
        assert models.loaded() == [] and chat.closed
        assert farm.state.heartbeats[-1]["catalog"]["loaded"] == [CHAT], (
            "the beat reported what was loaded when it was sent"
        )
        loop.heartbeat()
        assert farm.state.heartbeats[-1]["catalog"]["loaded"] == []
