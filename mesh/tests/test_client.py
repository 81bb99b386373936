"""mahout's ring client against the real ring API on a live server: a stage host pulls its
assignment, the bridge reports stage stats, and a stage host reads them back."""
from __future__ import annotations

import pytest

from conftest import make_host
from mahout.api import HostApiError
from mahout.ring.api import RingApi
from mesh.layouts import layout_seed
from mesh.models import ModelLayout
from mesh.services import StageSpec, ring_plan_create

pytestmark = pytest.mark.django_db(transaction=True)


class RingApiClientTests:
    def test_it_pulls_assignments_and_round_trips_stats(self, live_server, catalog) -> None:  # type: ignore[no-untyped-def]
        from marketplace.models import CatalogModel

        layout_seed(CatalogModel, ModelLayout)
        head, tail, bridge = make_host(name="head"), make_host(name="tail"), make_host(name="bridge")
        plan = ring_plan_create(
            model_name="gemma-3-270m", stages=[StageSpec(0, 9, head.host), StageSpec(9, 18, tail.host)],
            row_width=32, micro_batch=2, bridge_host=bridge.host,
        )
        as_head, as_bridge = RingApi(live_server.url, head.token, retries=0), RingApi(live_server.url, bridge.token, retries=0)
        try:
            (assignment,) = as_head.assignment()
            assert (assignment["ring"], assignment["start"], assignment["end"], assignment["micro_batch"]) == (plan.pk, 0, 9, 2)
            assert as_bridge.assignment() == []
            stages = [
                {"stage": 0, "start": 0, "end": 9, "hold_s": 0.5, "idle_s": 1.5, "queue_depth": 0, "batches": 7, "rows": 9},
                {"stage": 1, "start": 9, "end": 18, "hold_s": 1.5, "idle_s": 0.5, "queue_depth": 1, "batches": 7, "rows": 9},
            ]
            assert as_bridge.report_stats(plan.pk, stages) == {"updated": 2}
            shown = as_head.stats(plan.pk)["stages"]
            assert [(s["hold_share"], s["queue_depth"], s["batches"]) for s in shown] == [(0.25, 0, 7), (0.75, 1, 7)]
            with pytest.raises(HostApiError) as refused:
                as_head.report_stats(plan.pk, stages[1:])  # the head's host does not serve stage 1
            assert refused.value.status == 403 and refused.value.code == "not_your_stage"
        finally:
            as_head.close()
            as_bridge.close()

    def test_a_bridge_host_runs_the_plan_it_is_given_and_reports_its_stages(self, live_server, catalog) -> None:  # type: ignore[no-untyped-def]
        import argparse

        from mahout.ring.cli import _plan
        from mahout.ring.runner import _reporting
        from marketplace.models import CatalogModel

        layout_seed(CatalogModel, ModelLayout)
        bridge = make_host(name="bridge")
        plan = ring_plan_create(
            model_name="gemma-3-270m", stages=[StageSpec(0, 15), StageSpec(15, 18)], row_width=16, micro_batch=3,
            bridge_host=bridge.host,
        )
        args = argparse.Namespace(server=live_server.url, token=bridge.token, ring=plan.pk, report_every=60.0)
        assert _plan(args) == ([(0, 15), (15, 18)], 3, 16)

        class StatsBridge:  # what RingBridge.stats() returns, without a model
            def stats(self) -> list[dict]:
                return [{"stage": 0, "hold_s": 2.0, "idle_s": 2.0, "queue_depth": 0, "batches": 5},
                        {"stage": 1, "hold_s": 3.0, "idle_s": 1.0, "queue_depth": 4, "batches": 5}]

        with _reporting(StatsBridge(), args, say=lambda _line: None):  # type: ignore[arg-type]
            pass  # one report when serving ends
        shown = {stage.index: stage for stage in plan.stages.all()}
        assert (shown[0].hold_s, shown[1].hold_s, shown[1].queue_depth) == (2.0, 3.0, 4)
        assert shown[1].reported_at is not None
