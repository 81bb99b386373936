"""Starting a host with several models: qualify each, check the budget, load what fits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from mahout import host
from mahout.__main__ import build_parser
from mahout.api import HostApi, HostApiError
from mahout.catalog import CATALOG, ModelSpec, installed_models, parse_models
from mahout.loader import BudgetError

if TYPE_CHECKING:
    from collections.abc import Callable

CHAT, EMBED = "gemma-3-270m", "all-minilm-l6-v2"
FOOTPRINTS = {CHAT: 300.0, EMBED: 200.0}


def gateway_listing(*models: str) -> tuple[HostApi, list[dict]]:
    """A mock gateway that accepts qualifications for ``models`` and 404s the rest."""
    seen: list[dict] = []

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        if body["model"] not in models:
            error = {
                "message": f"No model named {body['model']}.",
                "type": "invalid_request_error",
                "code": "model_not_found",
            }
            return httpx.Response(404, json={"error": error})
        return httpx.Response(201, json={"model": body["model"], "fingerprint": body["fingerprint"]})

    return HostApi("http://gw.test", "t", retries=0, transport=httpx.MockTransport(handle)), seen


@pytest.fixture
def fake_models(monkeypatch) -> list[str]:
    """Benchmarks and loads that cost nothing; returns the names loaded, in order."""
    loads: list[str] = []

    def benchmark_model(
        name: str,
        home: Path,
        threads: int,
        *,
        rebenchmark: bool = False,
        out: Callable[[str], None] = print,
        gpu: object = None,
        budget_mb: int | None = None,
    ) -> host.Qualified:
        result = {
            "prompt_tps": 1.0,
            "gen_tps": 1.0,
            "ttft_ms": 1.0,
            "memory_mb": FOOTPRINTS[name],
            "threads": threads,
            "slots": 3,
        }  # (what the chat model's benchmark chose on this machine)
        return host.Qualified(Path(name), "sha", result, "fp", {"hostname": "box"}, name)

    def spec(name: str) -> ModelSpec:
        real = CATALOG[name]
        return ModelSpec(
            name,
            real.kind,
            (),
            real.locate,
            real.measure,
            lambda path, threads, offload=None, *, slots=1: loads.append(f"{name}×{slots}") or name,
        )

    monkeypatch.setattr(host, "benchmark_model", benchmark_model)
    monkeypatch.setattr(host, "CATALOG", {name: spec(name) for name in (CHAT, EMBED)})
    return loads


class StartHostTests:
    def test_it_qualifies_every_model_and_loads_what_fits_in_order(self, fake_models, tmp_path):
        api, seen = gateway_listing(CHAT, EMBED)
        loop = host.start_host(api, tmp_path, 1, models=[CHAT, EMBED], memory_budget_mb=400, out=lambda _l: None)
        assert [body["model"] for body in seen] == [CHAT, EMBED]
        assert seen[1]["benchmark"]["memory_mb"] == 200.0
        assert fake_models == [f"{CHAT}×3"], "the chat model serves the slots its benchmark chose"
        catalog = loop.catalog()
        assert (catalog["qualified"], catalog["loaded"], catalog["memory_budget_mb"]) == ([EMBED, CHAT], [CHAT], 400)
        assert (loop.slots, catalog["slots"]) == (3, 3), "the heartbeat says how many jobs the host takes at once"

    def test_slots_asked_for_override_the_benchmarks_choice(self, fake_models, tmp_path):
        api, _seen = gateway_listing(CHAT, EMBED)
        loop = host.start_host(
            api, tmp_path, 1, models=[CHAT, EMBED], memory_budget_mb=1000, out=lambda _l: None, slots=5
        )
        with loop.models.acquire(EMBED):
            pass
        assert fake_models == [f"{CHAT}×5", f"{EMBED}×5"]
        assert loop.catalog()["slots"] == 5

    def test_it_refuses_a_budget_too_small_before_registering_anything(self, fake_models, tmp_path):
        api, seen = gateway_listing(CHAT, EMBED)
        with pytest.raises(BudgetError, match="gemma-3-270m"):
            host.start_host(api, tmp_path, 1, models=[CHAT, EMBED], memory_budget_mb=250, out=lambda _l: None)
        assert seen == [] and fake_models == []

    def test_it_serves_the_others_when_the_gateway_does_not_list_a_model(self, fake_models, tmp_path):
        api, _seen = gateway_listing(CHAT)
        lines: list[str] = []
        loop = host.start_host(api, tmp_path, 1, models=[CHAT, EMBED], memory_budget_mb=1000, out=lines.append)
        assert loop.models.qualified == [CHAT]
        assert f"mahout: the gateway does not list {EMBED}; not serving it (No model named {EMBED}.)" in lines

    def test_it_raises_when_the_gateway_lists_none_of_them(self, fake_models, tmp_path):
        api, _seen = gateway_listing()
        with pytest.raises(HostApiError, match="404"):
            host.start_host(api, tmp_path, 1, models=[EMBED], memory_budget_mb=1000, out=lambda _l: None)

    def test_its_default_budget_is_half_the_memory(self):
        assert host.default_budget_mb() >= 1


class CatalogTests:
    def test_it_parses_a_comma_separated_model_list(self):
        assert parse_models(f" {EMBED},{CHAT},{EMBED} ") == [EMBED, CHAT]
        with pytest.raises(ValueError, match="unknown model"):
            parse_models("llama-70b")

    def test_it_lists_the_models_whose_packages_are_installed(self):
        assert installed_models() == sorted([CHAT, EMBED])

    def test_the_command_line_defaults_to_the_shipped_chat_model(self):
        args = build_parser().parse_args(["run", "--server", "http://gw", "--token", "t"])
        assert args.models == [CHAT] and args.memory_budget_mb is None
        args = build_parser().parse_args(
            ["run", "--server", "http://gw", "--token", "t", "--models", EMBED, "--memory-budget-mb", "1024"]
        )
        assert args.models == [EMBED] and args.memory_budget_mb == 1024

    def test_the_new_modules_never_import_django(self):
        import subprocess
        import sys

        modules = "mahout.catalog, mahout.loader, mahout.runners.embeddings, mahout.host"
        code = (
            f"import sys, {modules}; mahout.runners.embeddings.EmbeddingsRunner(threads=1); "
            "print(sorted(m for m in sys.modules if m.startswith('django')))"
        )
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
        assert result.stdout.strip().splitlines()[-1] == "[]"


class SlotsMemoryTests:
    def test_the_slots_a_benchmark_chose_are_as_many_as_their_kv_cache_fits_the_budget(
        self, fake_models, tmp_path, monkeypatch
    ):
        monkeypatch.setattr(host, "kv_mb", lambda model: 30.0)
        api, _seen = gateway_listing(CHAT)
        lines: list[str] = []
        budget = int(FOOTPRINTS[CHAT]) + 80  # room for two sequences' KV, not the three its benchmark chose
        loop = host.start_host(api, tmp_path, 1, models=[CHAT], memory_budget_mb=budget, out=lines.append)
        assert fake_models == [f"{CHAT}×2"] and loop.slots == 2
        assert any("serves 2 job(s) at once, not 3" in line for line in lines)
        assert loop.models.footprints_mb[CHAT] == FOOTPRINTS[CHAT] + 2 * 30.0, "the loader counts the KV it allocates"
