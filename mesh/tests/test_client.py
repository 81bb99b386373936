"""mahout's ring client against the real ring API on a live server: a stage host pulls its
assignment, the bridge reports stage stats, and a stage host reads them back; stages and
the bridge find each other through the address exchange."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from conftest import ServingHost, make_host
from mahout.api import HostApiError
from mahout.ring.api import RingApi
from mesh.rings.layouts import layout_seed
from mesh.rings.models import ModelLayout, RingPlan
from mesh.rings.services import StageSpec, ring_plan_create

if TYPE_CHECKING:
    from pytest_django.live_server_helper import LiveServer

    from catalog.models import CatalogModel

pytestmark = pytest.mark.django_db(transaction=True)


def _two_stage_ring() -> tuple[RingPlan, ServingHost, ServingHost, ServingHost]:
    """Layers 0-8 on a "head" host, 9-17 on a "tail" host, bridged by a third: (plan, head, tail, bridge)."""
    from catalog.models import CatalogModel

    layout_seed(CatalogModel, ModelLayout)
    head, tail, bridge = make_host(name="head"), make_host(name="tail"), make_host(name="bridge")
    plan = ring_plan_create(
        model_name="gemma-3-270m",
        stages=[StageSpec(0, 9, head.host), StageSpec(9, 18, tail.host)],
        row_width=32,
        micro_batch=2,
        bridge_host=bridge.host,
    )
    return plan, head, tail, bridge


class RingApiClientTests:
    def test_it_pulls_assignments_and_round_trips_stats(self, live_server: LiveServer, catalog: CatalogModel) -> None:
        plan, head, _tail, bridge = _two_stage_ring()
        as_head, as_bridge = (
            RingApi(live_server.url, head.token, retries=0),
            RingApi(live_server.url, bridge.token, retries=0),
        )
        try:
            (assignment,) = as_head.assignment()
            assert (assignment["ring"], assignment["start"], assignment["end"], assignment["micro_batch"]) == (
                plan.pk,
                0,
                9,
                2,
            )
            assert as_bridge.assignment() == []
            stages = [
                {
                    "stage": 0,
                    "start": 0,
                    "end": 9,
                    "hold_s": 0.5,
                    "idle_s": 1.5,
                    "queue_depth": 0,
                    "batches": 7,
                    "rows": 9,
                },
                {
                    "stage": 1,
                    "start": 9,
                    "end": 18,
                    "hold_s": 1.5,
                    "idle_s": 0.5,
                    "queue_depth": 1,
                    "batches": 7,
                    "rows": 9,
                },
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

    def test_a_bridge_host_runs_the_plan_it_is_given_and_reports_its_stages(
        self, live_server: LiveServer, catalog: CatalogModel
    ) -> None:
        import argparse

        from catalog.models import CatalogModel
        from mahout.ring.serve import _reporting

        layout_seed(CatalogModel, ModelLayout)
        bridge = make_host(name="bridge")
        plan = ring_plan_create(
            model_name="gemma-3-270m",
            stages=[StageSpec(0, 15), StageSpec(15, 18)],
            row_width=16,
            micro_batch=3,
            bridge_host=bridge.host,
        )
        args = argparse.Namespace(server=live_server.url, token=bridge.token, ring=plan.pk, report_every=60.0)
        as_bridge = RingApi(live_server.url, bridge.token, retries=0)
        try:  # host-less stages are the bridge host's to run
            mine = as_bridge.assignment()
        finally:
            as_bridge.close()
        assert [(a["stage"], a["start"], a["end"], a["micro_batch"], a["row_width"]) for a in mine] == [
            (0, 0, 15, 3, 16),
            (1, 15, 18, 3, 16),
        ]

        class StatsBridge:  # what RingBridge.stats() returns, without a model
            def stats(self) -> list[dict]:
                return [
                    {"stage": 0, "hold_s": 2.0, "idle_s": 2.0, "queue_depth": 0, "batches": 5},
                    {"stage": 1, "hold_s": 3.0, "idle_s": 1.0, "queue_depth": 4, "batches": 5},
                ]

        with _reporting(StatsBridge(), args, say=lambda _line: None):  # type: ignore[arg-type]
            pass  # one report when serving ends
        shown = {stage.index: stage for stage in plan.stages.all()}
        assert (shown[0].hold_s, shown[1].hold_s, shown[1].queue_depth) == (2.0, 3.0, 4)
        assert shown[1].reported_at is not None


class AddressExchangeTests:
    def test_stages_and_the_bridge_find_each_other_through_the_control_plane(
        self, live_server: LiveServer, catalog: CatalogModel, settings
    ) -> None:
        import threading

        settings.RING_ALLOW_PRIVATE_STAGES = True  # three owners' stages on loopback: the operator's local test ring

        from mahout.link import HEADERS_ONLY, accept, listen
        from mahout.ring.rendezvous import advertised_address, dial_stage

        plan, head, tail, bridge = _two_stage_ring()
        apis = {
            name: RingApi(live_server.url, who.token, retries=0)
            for name, who in (("head", head), ("tail", tail), ("bridge", bridge))
        }
        server = listen("0.0.0.0", 0)
        try:
            address = advertised_address(server, None, live_server.url)  # a wildcard bind: the route to the gateway
            assert address == f"127.0.0.1:{server.getsockname()[1]}"
            apis["tail"].report_address(plan.pk, 1, address)
            with pytest.raises(HostApiError) as refused:
                apis["head"].report_address(plan.pk, 1, "10.0.0.9:4000")  # not the head's stage
            assert (refused.value.status, refused.value.code) == (403, "not_your_stage")
            with pytest.raises(HostApiError) as wildcard:
                apis["head"].report_address(plan.pk, 0, "0.0.0.0:4000")
            assert (wildcard.value.status, wildcard.value.code) == (400, "address_invalid")
            (sent,) = [a["links"]["downstream"] for a in apis["head"].assignment()]
            (received,) = [a["links"]["upstream"] for a in apis["tail"].assignment()]
            assert sent == {"stage": 1, "secret": received["secret"]} and received["stage"] == 0
            secret = sent["secret"]
            assert secret not in {apis["bridge"].bridge_keys(plan.pk).head, apis["bridge"].bridge_keys(plan.pk).tail}
            admitted: list = []
            listener = threading.Thread(
                target=lambda: admitted.append(accept(server.accept()[0], secret=secret, caps=HEADERS_ONLY)),
                daemon=True,
            )
            listener.start()
            link = dial_stage(
                apis["head"],
                plan.pk,
                1,
                secret=secret,
                hello={"role": "upstream", "stage": 0},
                caps=HEADERS_ONLY,
                timeout=5,
                say=lambda _l: None,
            )
            listener.join(5)
            link.close()
            assert admitted and admitted[0].peer["role"] == "upstream"
            admitted[0].close()
            assert [(s["stage"], s["address"]) for s in apis["bridge"].addresses(plan.pk)] == [(0, ""), (1, address)]
        finally:
            server.close()
            for api in apis.values():
                api.close()

    def test_a_host_proposes_its_own_ring_once_and_gets_it_back_on_restart(
        self, live_server: LiveServer, catalog: CatalogModel
    ) -> None:
        from catalog.models import CatalogModel

        layout_seed(CatalogModel, ModelLayout)
        host = make_host(name="solo")
        api = RingApi(live_server.url, host.token, retries=0)
        try:
            first = api.propose(model="gemma-3-270m", stages=3, row_width=64, micro_batch=4)
            again = api.propose(model="gemma-3-270m", stages=3, row_width=64, micro_batch=4)
            assert first["ring"] == again["ring"]
            assert [(s["start"], s["end"], s["host"]) for s in first["stages"]] == [
                (0, 6, host.host.pk),
                (6, 12, host.host.pk),
                (12, 18, host.host.pk),
            ]
            assert [a["stage"] for a in api.assignment()] == [0, 1, 2]
            with pytest.raises(HostApiError) as refused:
                api.propose(model="gemma-3-270m", stages=1, row_width=64, micro_batch=4)
            assert refused.value.status == 400 and "at least two stages" in str(refused.value)
        finally:
            api.close()
