"""The loading policy: a memory budget, least recently used out, busy models never unloaded."""

from __future__ import annotations

import threading
import time

import pytest

from mahout import loader as loader_module
from mahout.loader import BudgetError, ModelLoader, UnknownModel


class FakeModel:
    def __init__(self, name: str) -> None:
        self.name, self.closed = name, False

    def close(self) -> None:
        self.closed = True


class Loads:
    """A fake ``load`` that records what it loaded."""

    def __init__(self) -> None:
        self.loaded: list[str] = []
        self.models: dict[str, FakeModel] = {}

    def __call__(self, name: str) -> FakeModel:
        self.loaded.append(name)
        self.models[name] = FakeModel(name)
        return self.models[name]


FOOTPRINTS = {"chat": 300.0, "embed": 200.0, "big": 500.0}


def loader(budget: int, loads: Loads, lines: list[str] | None = None) -> ModelLoader:
    return ModelLoader(loads, FOOTPRINTS, budget, out=(lines if lines is not None else []).append)


def use(models: ModelLoader, name: str) -> object:
    with models.acquire(name) as runner:
        return runner


class ModelLoaderTests:
    def test_it_loads_a_cold_model_once_and_keeps_it_warm(self):
        loads = Loads()
        models = loader(1000, loads)
        first, second = use(models, "chat"), use(models, "chat")
        assert first is second and loads.loaded == ["chat"]
        assert models.loaded() == ["chat"] and models.used_mb() == 300.0

    def test_it_unloads_the_least_recently_used_model_to_fit_a_cold_one(self):
        loads, lines = Loads(), []
        models = loader(600, loads, lines)
        use(models, "chat")
        use(models, "embed")
        use(models, "chat")  # now "embed" is the least recently used
        use(models, "big")  # 500 MB in a 600 MB budget: both must go, the least recently used first
        assert loads.models["embed"].closed and loads.models["chat"].closed
        assert models.loaded() == ["big"] and models.used_mb() <= 600
        assert lines.index("mahout: unloading embed (least recently used) to make room for big") < lines.index(
            "mahout: unloading chat (least recently used) to make room for big"
        )

    def test_it_unloads_only_what_it_must(self):
        loads = Loads()
        models = loader(800, loads)
        use(models, "chat")
        use(models, "embed")
        use(models, "big")  # 300 + 200 + 500 > 800: the LRU (chat) goes, embed stays
        assert models.loaded() == ["embed", "big"]
        assert loads.models["chat"].closed and not loads.models["embed"].closed

    def test_it_reloads_a_model_it_unloaded(self):
        loads = Loads()
        models = loader(500, loads)
        for name in ("chat", "big", "chat"):
            use(models, name)
        assert loads.loaded == ["chat", "big", "chat"] and models.loaded() == ["chat"]

    def test_it_never_unloads_a_model_serving_a_job(self, monkeypatch):
        monkeypatch.setattr(loader_module, "ROOM_WAIT_SECONDS", 0.2)
        loads = Loads()
        models = loader(600, loads)
        with models.acquire("chat"):
            with pytest.raises(BudgetError, match="cannot load big within 600 MB while chat serve jobs"):
                use(models, "big")
            assert not loads.models["chat"].closed
        use(models, "big")  # once the job is done, chat can go
        assert models.loaded() == ["big"]

    def test_a_cold_model_waits_for_a_busy_one_to_be_given_back_then_takes_its_room(self):
        loads = Loads()
        models = loader(600, loads)
        released = threading.Event()

        def a_running_job() -> None:
            with models.acquire("chat"):
                started.set()
                time.sleep(0.3)
            released.set()

        started = threading.Event()
        threading.Thread(target=a_running_job).start()
        started.wait(5)
        use(models, "big")  # (a job for a cold model, claimed by a host serving several at once)
        assert released.is_set() and loads.models["chat"].closed, "it waited for the job, then unloaded its model"
        assert models.loaded() == ["big"]

    def test_it_refuses_a_budget_smaller_than_one_model(self):
        with pytest.raises(BudgetError, match=r"big \(~500 MB\) cannot fit in a memory budget of 400 MB"):
            loader(400, Loads())

    def test_it_refuses_a_model_it_does_not_serve(self):
        with pytest.raises(UnknownModel):
            use(loader(1000, Loads()), "llama-70b")

    def test_it_preloads_in_order_only_what_fits_without_unloading(self):
        loads = Loads()
        models = loader(600, loads)
        assert models.preload(["chat", "big", "embed"]) == ["chat", "embed"]
        assert loads.loaded == ["chat", "embed"]

    def test_a_fixed_loader_serves_its_runners_and_loads_nothing(self):
        runner = FakeModel("chat")
        models = ModelLoader.fixed({"chat": runner})
        assert use(models, "chat") is runner and models.loaded() == ["chat"] and models.budget_mb == 0
        with pytest.raises(UnknownModel):
            use(models, "embed")
