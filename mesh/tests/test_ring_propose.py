"""Ring plans proposed from the hosts' advertised memory (their heartbeat catalogs)."""
from __future__ import annotations

import pytest
from django.core.management import CommandError, call_command

from conftest import make_host
from hosts.models import Host
from mesh.rings.services import PlanInvalid, memory_split, ring_plan_propose

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
    plan = ring_plan_propose(model_name="gemma-3-270m", hosts=[big, small], bridge_host=bridge, layer_mb=50,
                             row_width=64, micro_batch=4)
    stages = [(s.start, s.end, s.host_id) for s in plan.stages.order_by("index")]
    assert stages == [(0, 12, big.pk), (12, 18, small.pk)] and plan.bridge_host_id == bridge.pk


def test_it_refuses_silent_hosts_too_little_memory_and_a_single_stage(catalog) -> None:
    with pytest.raises(PlanInvalid, match="has not advertised its memory"):
        ring_plan_propose(model_name="gemma-3-270m", hosts=[advertising("a", 1000), advertising("mute", None)],
                          bridge_host=None, layer_mb=50, row_width=64, micro_batch=4)
    with pytest.raises(PlanInvalid, match="holds 4 of the model's 18 layers"):
        ring_plan_propose(model_name="gemma-3-270m", hosts=[advertising("t1", 100), advertising("t2", 100)],
                          bridge_host=None, layer_mb=50, row_width=64, micro_batch=4)
    with pytest.raises(PlanInvalid, match="at least two stages"):
        ring_plan_propose(model_name="gemma-3-270m", hosts=[advertising("solo", 5000)], bridge_host=None,
                          layer_mb=50, row_width=64, micro_batch=4)


def test_the_operator_command_prints_the_stages(catalog, capsys) -> None:
    advertising("rig-a", 900)
    advertising("rig-b", 900)
    call_command("ring_propose", "gemma-3-270m", "--hosts", "rig-a,rig-b", "--layer-mb", "50")
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["stage 0: layers [0, 9) on rig-a", "stage 1: layers [9, 18) on rig-b"] and out[2].isdigit()
    with pytest.raises(CommandError, match="no host 'nope'"):
        call_command("ring_propose", "gemma-3-270m", "--hosts", "rig-a,nope", "--layer-mb", "50")
