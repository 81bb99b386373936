"""Ring plans: a valid plan is stored; every bad plan is refused with a clear reason."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from conftest import make_host
from hosts.models import Host
from mesh.rings.layouts import layout_seed
from mesh.rings.models import ModelLayout, RingPlan, RingStage
from mesh.rings.services import (
    AddressInvalid,
    NotAParticipant,
    NotYourStage,
    PlanInvalid,
    StageSpec,
    ring_plan_create,
    ring_plan_propose_local,
    ring_stage_address_report,
    ring_stage_leave,
    ring_stats_report,
)

if TYPE_CHECKING:
    from typing import Any

    from catalog.models import CatalogModel

pytestmark = pytest.mark.django_db


@pytest.fixture
def layouts(catalog: CatalogModel) -> CatalogModel:
    from catalog.models import CatalogModel

    layout_seed(CatalogModel, ModelLayout)
    return catalog


def _create(
    *ranges: tuple[int, int], row_width: int = 64, micro_batch: int = 4, model: str = "gemma-3-270m"
) -> RingPlan:
    return ring_plan_create(
        model_name=model,
        stages=[StageSpec(start, end) for start, end in ranges],
        row_width=row_width,
        micro_batch=micro_batch,
    )


class RingPlanCreateTests:
    def test_it_stores_a_plan_covering_every_layer_once(self, layouts: CatalogModel) -> None:
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
    def test_it_refuses_a_bad_plan(
        self, layouts: CatalogModel, ranges: list[tuple[int, int]], kwargs: dict[str, Any], reason: str
    ) -> None:
        with pytest.raises(PlanInvalid, match=reason.replace("[", r"\[").replace(")", r"\)").replace("(", r"\(")):
            _create(*ranges, **kwargs)
        assert not RingPlan.objects.exists() and not RingStage.objects.exists()

    def test_it_refuses_a_model_whose_layer_count_is_unknown(self, catalog: CatalogModel) -> None:
        ModelLayout.objects.all().delete()
        type(catalog).objects.filter(pk=catalog.pk).update(n_layers=None)
        with pytest.raises(PlanInvalid, match="layer count"):
            _create((0, 9), (9, 18))


class RingStatsReportTests:
    def test_it_lets_a_stage_host_report_only_its_own_stage(self, layouts: CatalogModel) -> None:
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


class RingStageAddressReportTests:
    def test_it_records_where_a_stage_listens_for_the_host_that_runs_it(self, layouts: CatalogModel, settings) -> None:
        settings.RING_ALLOW_PRIVATE_STAGES = True  # strangers on one network: the operator's local test rings
        a, b, bridge = make_host(name="a").host, make_host(name="b").host, make_host(name="bridge").host
        plan = ring_plan_create(
            model_name="gemma-3-270m",
            stages=[StageSpec(0, 9, a), StageSpec(9, 18)],
            row_width=8,
            micro_batch=2,
            bridge_host=bridge,
        )
        stage = ring_stage_address_report(plan_id=plan.pk, index=0, host=a, address=" 192.168.1.20:7000 ")
        assert (stage.address, stage.address_reported_at is not None) == ("192.168.1.20:7000", True)
        assert (
            ring_stage_address_report(plan_id=plan.pk, index=1, host=bridge, address="[fd00::2]:7001").address
            == "[fd00::2]:7001"
        )
        with pytest.raises(NotYourStage, match="does not run stage 1"):
            ring_stage_address_report(plan_id=plan.pk, index=1, host=a, address="10.0.0.1:7000")
        with pytest.raises(NotAParticipant, match="takes no part"):
            ring_stage_address_report(plan_id=plan.pk, index=0, host=b, address="10.0.0.1:7000")
        assert RingStage.objects.get(plan=plan, index=0).address == "192.168.1.20:7000"

    @pytest.mark.parametrize("address", ["0.0.0.0:7000", "[::]:7000", "host", "host:0", "host:70000", ":7000", "a b:1"])
    def test_it_refuses_an_address_nobody_can_dial(self, layouts: CatalogModel, address: str) -> None:
        a = make_host(name="a").host
        plan = ring_plan_create(
            model_name="gemma-3-270m", stages=[StageSpec(0, 9, a), StageSpec(9, 18, a)], row_width=8, micro_batch=2
        )
        with pytest.raises(AddressInvalid):
            ring_stage_address_report(plan_id=plan.pk, index=0, host=a, address=address)

    def test_a_ring_of_strangers_dials_only_public_addresses_and_an_owners_own_ring_its_network(
        self, layouts: CatalogModel
    ) -> None:
        a, b = make_host(name="a").host, make_host(name="b").host  # two owners
        strangers = ring_plan_create(
            model_name="gemma-3-270m", stages=[StageSpec(0, 9, a), StageSpec(9, 18, b)], row_width=8, micro_batch=2
        )
        for address in (
            "127.0.0.1:7000",
            "10.0.0.1:7000",
            "192.168.1.20:7000",
            "[::1]:7000",
            "169.254.169.254:80",
            "[::ffff:127.0.0.1]:7000",
            "localhost:7000",
            "no-such-host.invalid:7000",
        ):
            with pytest.raises(AddressInvalid, match="is not public|does not resolve"):
                ring_stage_address_report(plan_id=strangers.pk, index=0, host=a, address=address)
        assert (
            ring_stage_address_report(plan_id=strangers.pk, index=0, host=a, address="8.8.8.8:7000").address
            == "8.8.8.8:7000"
        )
        assert RingStage.objects.get(plan=strangers, index=1).address == ""
        mine = make_host(name="a2").host
        Host.objects.filter(pk=mine.pk).update(owner=a.owner)
        own = ring_plan_create(
            model_name="gemma-3-270m", stages=[StageSpec(0, 9, a), StageSpec(9, 18, mine)], row_width=8, micro_batch=2
        )
        assert (
            ring_stage_address_report(plan_id=own.pk, index=1, host=mine, address="192.168.1.21:7001").address
            == "192.168.1.21:7001"
        )

    def test_a_private_address_in_a_ring_of_strangers_is_refused_with_the_relay_named(
        self, layouts: CatalogModel
    ) -> None:
        """Issue 50: the refusal says the relay exists, under a code `mahout stage` falls back on."""
        a, b = make_host(name="a").host, make_host(name="b").host
        plan = ring_plan_create(
            model_name="gemma-3-270m", stages=[StageSpec(0, 9, a), StageSpec(9, 18, b)], row_width=8, micro_batch=2
        )
        with pytest.raises(AddressInvalid, match="is not public") as refused:
            ring_stage_address_report(plan_id=plan.pk, index=0, host=a, address="192.168.1.20:7000")
        assert refused.value.code == "address_not_public" and "--relay" in refused.value.message

    def test_a_stage_behind_nat_reports_the_relay_which_needs_no_public_address(self, layouts: CatalogModel) -> None:
        a, b = make_host(name="a").host, make_host(name="b").host  # two owners: their stages dial only public addresses
        plan = ring_plan_create(
            model_name="gemma-3-270m", stages=[StageSpec(0, 9, a), StageSpec(9, 18, b)], row_width=8, micro_batch=2
        )
        assert ring_stage_address_report(plan_id=plan.pk, index=0, host=a, address=" relay ").address == "relay"
        with pytest.raises(AddressInvalid):
            ring_stage_address_report(plan_id=plan.pk, index=1, host=b, address="relay:1")

    def test_a_retired_ring_takes_no_address(self, layouts: CatalogModel) -> None:
        a = make_host(name="a").host
        plan = ring_plan_create(
            model_name="gemma-3-270m", stages=[StageSpec(0, 9, a), StageSpec(9, 18, a)], row_width=8, micro_batch=2
        )
        RingPlan.objects.filter(pk=plan.pk).update(status=RingPlan.Status.RETIRED)
        with pytest.raises(NotAParticipant):
            ring_stage_address_report(plan_id=plan.pk, index=0, host=a, address="10.0.0.1:7000")


class RingStageLeaveTests:
    def test_a_stage_that_leaves_clears_its_address_unless_it_reported_another_since(
        self, layouts: CatalogModel, settings
    ) -> None:
        settings.RING_ALLOW_PRIVATE_STAGES = True
        a, bridge = make_host(name="a").host, make_host(name="bridge").host
        plan = ring_plan_create(
            model_name="gemma-3-270m",
            stages=[StageSpec(0, 9, a), StageSpec(9, 18)],
            row_width=8,
            micro_batch=2,
            bridge_host=bridge,
        )
        ring_stage_address_report(plan_id=plan.pk, index=0, host=a, address="10.0.0.1:7000")
        ring_stage_address_report(plan_id=plan.pk, index=0, host=a, address="10.0.0.1:7001")  # it rejoined elsewhere
        assert not ring_stage_leave(plan_id=plan.pk, index=0, host=a, address="10.0.0.1:7000")  # a late leave
        assert RingStage.objects.get(plan=plan, index=0).address == "10.0.0.1:7001"
        assert ring_stage_leave(plan_id=plan.pk, index=0, host=a, address="10.0.0.1:7001")
        assert RingStage.objects.get(plan=plan, index=0).address == ""
        assert not ring_stage_leave(plan_id=plan.pk, index=0, host=a, address="")

    def test_only_the_host_running_the_stage_may_clear_it_even_in_a_retired_ring(
        self, layouts: CatalogModel, settings
    ) -> None:
        settings.RING_ALLOW_PRIVATE_STAGES = True
        a, b = make_host(name="a").host, make_host(name="b").host
        plan = ring_plan_create(
            model_name="gemma-3-270m", stages=[StageSpec(0, 9, a), StageSpec(9, 18, b)], row_width=8, micro_batch=2
        )
        ring_stage_address_report(plan_id=plan.pk, index=1, host=b, address="10.0.0.2:7000")
        with pytest.raises(NotYourStage):
            ring_stage_leave(plan_id=plan.pk, index=1, host=a, address="10.0.0.2:7000")
        with pytest.raises(NotAParticipant):
            ring_stage_leave(plan_id=plan.pk, index=1, host=make_host(name="outsider").host, address="10.0.0.2:7000")
        RingPlan.objects.filter(pk=plan.pk).update(status=RingPlan.Status.RETIRED)
        assert ring_stage_leave(plan_id=plan.pk, index=1, host=b, address="10.0.0.2:7000")


class RingPlanProposeLocalTests:
    def test_it_puts_every_stage_on_the_host_and_reuses_the_same_shape(self, layouts: CatalogModel) -> None:
        host = make_host(name="solo").host
        plan = ring_plan_propose_local(host=host, model_name="gemma-3-270m", n_stages=4, row_width=64, micro_batch=4)
        assert [(s.start, s.end, s.host) for s in plan.stages.all()] == [
            (0, 5, host),
            (5, 10, host),
            (10, 14, host),
            (14, 18, host),
        ]
        assert plan.bridge_host == host
        assert (
            ring_plan_propose_local(host=host, model_name="gemma-3-270m", n_stages=4, row_width=64, micro_batch=4)
            == plan
        )
        other = ring_plan_propose_local(host=host, model_name="gemma-3-270m", n_stages=2, row_width=64, micro_batch=4)
        assert other != plan and other.stages.count() == 2

    def test_it_refuses_one_stage(self, layouts: CatalogModel) -> None:
        with pytest.raises(PlanInvalid, match="at least two stages"):
            ring_plan_propose_local(
                host=make_host(name="solo").host, model_name="gemma-3-270m", n_stages=1, row_width=64, micro_batch=4
            )
