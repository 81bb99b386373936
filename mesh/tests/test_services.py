"""Ring plans: a valid plan is stored; every bad plan is refused with a clear reason."""
from __future__ import annotations

import pytest

from conftest import make_host
from mesh.layouts import layout_seed
from mesh.models import ModelLayout, RingPlan, RingStage
from mesh.services import NotYourStage, PlanInvalid, StageSpec, ring_plan_create, ring_stats_report

pytestmark = pytest.mark.django_db


@pytest.fixture
def layouts(catalog):  # type: ignore[no-untyped-def]
    from marketplace.models import CatalogModel

    layout_seed(CatalogModel, ModelLayout)
    return catalog


def _create(*ranges: tuple[int, int], row_width: int = 64, micro_batch: int = 4, model: str = "gemma-3-270m") -> RingPlan:
    return ring_plan_create(
        model_name=model, stages=[StageSpec(start, end) for start, end in ranges], row_width=row_width, micro_batch=micro_batch
    )


class RingPlanCreateTests:
    def test_it_stores_a_plan_covering_every_layer_once(self, layouts) -> None:  # type: ignore[no-untyped-def]
        host = make_host(name="stage-host").host
        plan = ring_plan_create(
            model_name="gemma-3-270m", stages=[StageSpec(0, 9, host), StageSpec(9, 18)], row_width=64, micro_batch=4
        )
        assert (plan.n_layers, plan.row_width, plan.micro_batch) == (18, 64, 4)
        assert [(s.index, s.start, s.end, s.host) for s in plan.stages.all()] == [(0, 0, 9, host), (1, 9, 18, None)]

    @pytest.mark.parametrize(
        ("ranges", "kwargs", "reason"),
        [
            ([(0, 18)], {}, "a pipeline needs at least two stages"),
            ([], {}, "a pipeline needs at least two stages"),
            ([(0, 8), (9, 18)], {}, "layers [8, 9) are in no stage"),
            ([(0, 10), (9, 18)], {}, "overlaps layers before 10"),
            ([(0, 9), (9, 19)], {}, "runs past the model's 18 layers"),
            ([(0, 9), (9, 17)], {}, "layers [17, 18) are in no stage"),
            ([(1, 9), (9, 18)], {}, "layers [0, 1) are in no stage"),
            ([(0, 9), (9, 9), (9, 18)], {}, "empty range"),
            ([(9, 18), (0, 9)], {}, "layers [0, 9) are in no stage"),
            ([(0, 9), (9, 18)], {"micro_batch": 0}, "micro-batch must be positive"),
            ([(0, 9), (9, 18)], {"row_width": 0}, "row width must be positive"),
            ([(0, 9), (9, 18)], {"row_width": -3}, "row width must be positive"),
            ([(0, 9), (9, 18)], {"model": "no-such-model"}, "unknown model"),
        ],
    )
    def test_it_refuses_a_bad_plan(self, layouts, ranges, kwargs, reason) -> None:  # type: ignore[no-untyped-def]
        with pytest.raises(PlanInvalid, match=reason.replace("[", r"\[").replace(")", r"\)").replace("(", r"\(")):
            _create(*ranges, **kwargs)
        assert not RingPlan.objects.exists() and not RingStage.objects.exists()

    def test_it_refuses_a_model_whose_layer_count_is_unknown(self, catalog) -> None:  # type: ignore[no-untyped-def]
        ModelLayout.objects.all().delete()
        with pytest.raises(PlanInvalid, match="layer count"):
            _create((0, 9), (9, 18))


class RingStatsReportTests:
    def test_it_lets_a_stage_host_report_only_its_own_stage(self, layouts) -> None:  # type: ignore[no-untyped-def]
        a, b = make_host(name="a").host, make_host(name="b").host
        plan = ring_plan_create(
            model_name="gemma-3-270m", stages=[StageSpec(0, 9, a), StageSpec(9, 18, b)], row_width=8, micro_batch=2
        )
        reports = [{"stage": i, "hold_s": 1.5, "idle_s": 0.5, "queue_depth": 3} for i in (0, 1)]
        with pytest.raises(NotYourStage, match="does not serve stage 1"):
            ring_stats_report(plan_id=plan.pk, host=a, stages=reports)
        assert ring_stats_report(plan_id=plan.pk, host=a, stages=reports[:1]) == 1
        stages = list(plan.stages.all())
        assert (stages[0].hold_s, stages[0].queue_depth, stages[1].hold_s) == (1.5, 3, 0.0)
