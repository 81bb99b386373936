"""Ring plans proposed from the hosts' advertised memory (their heartbeat catalogs)."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from catalog.models import CatalogModel
from catalog.services import catalog_model_add
from conftest import make_host
from engine.arch import layer_bytes
from engine.gguf_meta import open_gguf
from hosts.models import Host
from mesh.rings.models import ModelLayout
from mesh.rings.services import PlanInvalid, layer_mb_read, memory_split, ring_plan_propose

pytestmark = pytest.mark.django_db


def advertising(name: str, budget_mb: int | None) -> Host:
    host = make_host(name=name).host
    Host.objects.filter(pk=host.pk).update(catalog={} if budget_mb is None else {"memory_budget_mb": budget_mb})
    return Host.objects.get(pk=host.pk)


def test_layers_follow_memory_and_never_exceed_what_a_host_holds() -> None:
    assert memory_split(n_layers=18, capacities=[20, 10, 10]) == [9, 5, 4]
    assert memory_split(n_layers=18, capacities=[3, 100]) == [1, 17]  # proportional, not greedy
    assert memory_split(n_layers=18, capacities=[10, 8]) == [10, 8]  # full: each holds all it can
    assert sum(memory_split(n_layers=18, capacities=[7, 7, 7])) == 18
    with pytest.raises(PlanInvalid, match="holds 10 of the model's 18 layers"):
        memory_split(n_layers=18, capacities=[5, 5])


def test_a_plan_is_proposed_from_advertised_memory(catalog) -> None:
    big, small, bridge = advertising("big", 1000), advertising("small", 500), advertising("bridge", 100)
    plan = ring_plan_propose(
        model_name="gemma-3-270m", hosts=[big, small], bridge_host=bridge, layer_mb=50, row_width=64, micro_batch=4
    )
    stages = [(s.start, s.end, s.host_id) for s in plan.stages.order_by("index")]
    assert stages == [(0, 12, big.pk), (12, 18, small.pk)] and plan.bridge_host_id == bridge.pk


def test_it_refuses_silent_hosts_too_little_memory_and_a_single_stage(catalog) -> None:
    with pytest.raises(PlanInvalid, match="has not advertised its memory"):
        ring_plan_propose(
            model_name="gemma-3-270m",
            hosts=[advertising("a", 1000), advertising("mute", None)],
            bridge_host=None,
            layer_mb=50,
            row_width=64,
            micro_batch=4,
        )
    with pytest.raises(PlanInvalid, match="holds 4 of the model's 18 layers"):
        ring_plan_propose(
            model_name="gemma-3-270m",
            hosts=[advertising("t1", 100), advertising("t2", 100)],
            bridge_host=None,
            layer_mb=50,
            row_width=64,
            micro_batch=4,
        )
    with pytest.raises(PlanInvalid, match="at least two stages"):
        ring_plan_propose(
            model_name="gemma-3-270m",
            hosts=[advertising("solo", 5000)],
            bridge_host=None,
            layer_mb=50,
            row_width=64,
            micro_batch=4,
        )


def test_the_operator_command_prints_the_stages(catalog, capsys) -> None:
    advertising("rig-a", 900)
    advertising("rig-b", 900)
    call_command("ring_propose", "gemma-3-270m", "--hosts", "rig-a,rig-b", "--layer-mb", "50")
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["stage 0: layers [0, 9) on rig-a", "stage 1: layers [9, 18) on rig-b"] and out[2].isdigit()
    with pytest.raises(CommandError, match="no host 'nope'"):
        call_command("ring_propose", "gemma-3-270m", "--hosts", "rig-a,nope", "--layer-mb", "50")


class FamilyRingPlanTests:
    """A catalog entry of a Llama-architecture family (added with catalog_add from its own file)
    is planned from the file alone: its block count, and one layer's memory as the engine
    holds it. What the ring's engine cannot run is refused, saying why."""

    def _add(self, family_files: dict[str, Path], family: str, name: str) -> CatalogModel:
        return catalog_model_add(path=family_files[family], name=name, input_price="0.10", output_price="0.40")

    def test_a_qwen3_entry_is_planned_from_its_file(self, catalog, family_files, var_dir) -> None:
        entry = self._add(family_files, "qwen3", "tiny-qwen3")
        assert not ModelLayout.objects.filter(model=entry).exists()
        held = layer_bytes(open_gguf(family_files["qwen3"]))
        # q, k, v, o (k and v for 2 of 4 heads) and three 64x128 feed-forward matrices in float16; 4 norms in float32
        assert held == 2 * (64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 64 * 128) + 4 * (2 * 64 + 2 * 16)
        assert layer_mb_read(entry) == held / 2**20
        plan = ring_plan_propose(
            model_name="tiny-qwen3",
            hosts=[advertising("q1", 1), advertising("q2", 1)],
            bridge_host=None,
            row_width=64,
            micro_batch=4,
        )
        assert plan.n_layers == entry.n_layers == 2
        assert [(s.start, s.end) for s in plan.stages.order_by("index")] == [(0, 1), (1, 2)]

    def test_the_operator_command_reads_the_layer_size_from_the_file(
        self, catalog, family_files, var_dir, capsys
    ) -> None:
        self._add(family_files, "llama3", "tiny-llama")
        advertising("rig-a", 900)
        advertising("rig-b", 900)
        call_command("ring_propose", "tiny-llama", "--hosts", "rig-a,rig-b")
        assert capsys.readouterr().out.splitlines()[:2] == [
            "stage 0: layers [0, 1) on rig-a",
            "stage 1: layers [1, 2) on rig-b",
        ]

    def test_it_refuses_an_architecture_the_engine_does_not_run(self, catalog, family_files, var_dir) -> None:
        self._add(family_files, "phi3", "tiny-phi3")
        with pytest.raises(
            PlanInvalid, match="'tiny-phi3' is a phi3 model; a ring's engine runs gemma3, llama, qwen2, qwen3"
        ):
            ring_plan_propose(
                model_name="tiny-phi3",
                hosts=[advertising("p1", 900), advertising("p2", 900)],
                bridge_host=None,
                row_width=64,
                micro_batch=4,
            )

    def test_it_refuses_a_mixture_of_experts_and_an_embedding_model(self, catalog) -> None:
        CatalogModel.objects.filter(name="gemma-3-270m").update(n_experts=8)
        with pytest.raises(PlanInvalid, match="mixture of experts: the expert market serves it"):
            ring_plan_propose(
                model_name="gemma-3-270m",
                hosts=[advertising("m1", 900), advertising("m2", 900)],
                bridge_host=None,
                layer_mb=50,
                row_width=64,
                micro_batch=4,
            )
        with pytest.raises(
            PlanInvalid, match="'all-minilm-l6-v2' is not a chat model \\(embedding\\); a ring serves chat models"
        ):
            ring_plan_propose(
                model_name="all-minilm-l6-v2",
                hosts=[advertising("e1", 900), advertising("e2", 900)],
                bridge_host=None,
                layer_mb=50,
                row_width=64,
                micro_batch=4,
            )

    def test_without_a_weights_file_it_asks_for_the_layer_size(self, catalog) -> None:
        CatalogModel.objects.filter(name="gemma-3-270m").update(weights_path="")
        with pytest.raises(
            PlanInvalid, match="holds no weights file for 'gemma-3-270m': give the memory one layer takes"
        ):
            ring_plan_propose(
                model_name="gemma-3-270m",
                hosts=[advertising("w1", 900), advertising("w2", 900)],
                bridge_host=None,
                row_width=64,
                micro_batch=4,
            )
