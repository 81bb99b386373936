"""The ring API: hosts pull their assignment and report / read stage time use; each link's
secret goes to its two ends only, and only a stage's neighbours may dial it through the relay."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from django.test import Client

from conftest import make_host
from mesh.rings.layouts import layout_seed
from mesh.rings.models import ModelLayout, RingPlan
from mesh.rings.services import StageSpec, ring_plan_create

if TYPE_CHECKING:
    from catalog.models import CatalogModel
    from testkit.personas import ServingHost

pytestmark = pytest.mark.django_db


@pytest.fixture
def plan_and_hosts(catalog: CatalogModel) -> tuple[RingPlan, ServingHost, ServingHost, ServingHost]:
    from catalog.models import CatalogModel

    layout_seed(CatalogModel, ModelLayout)
    head, tail, bridge = make_host(name="head"), make_host(name="tail"), make_host(name="bridge")
    plan = ring_plan_create(
        model_name="gemma-3-270m",
        stages=[StageSpec(0, 9, head.host), StageSpec(9, 18, tail.host)],
        row_width=64,
        micro_batch=4,
        bridge_host=bridge.host,
    )
    return plan, head, tail, bridge


def _auth(token: str) -> dict:
    return {"HTTP_AUTHORIZATION": f"Bearer {token}"}


class RingAssignmentApiTests:
    def test_it_hands_a_stage_host_its_layer_range_and_the_plan(
        self, plan_and_hosts: tuple[RingPlan, ServingHost, ServingHost, ServingHost]
    ) -> None:
        plan, head, tail, _ = plan_and_hosts
        answer = Client().get("/api/rings/assignment", **_auth(tail.token))
        assert answer.status_code == 200
        (assignment,) = answer.json()["assignments"]
        assert assignment["ring"] == plan.pk and assignment["model"] == "gemma-3-270m"
        assert (assignment["stage"], assignment["start"], assignment["end"]) == (1, 9, 18)
        assert (assignment["row_width"], assignment["micro_batch"]) == (64, 4)
        assert [(s["start"], s["end"]) for s in assignment["stages"]] == [(0, 9), (9, 18)]

    def test_it_refuses_an_outsider(
        self, plan_and_hosts: tuple[RingPlan, ServingHost, ServingHost, ServingHost]
    ) -> None:
        assert Client().get("/api/rings/assignment").status_code == 401
        assert Client().get("/api/rings/assignment", **_auth("host_nope")).status_code == 401


class RingStatsApiTests:
    def test_it_shows_what_the_bridge_reported_for_every_stage(
        self, plan_and_hosts: tuple[RingPlan, ServingHost, ServingHost, ServingHost]
    ) -> None:
        plan, head, _, bridge = plan_and_hosts
        body = {
            "stages": [
                {"stage": 0, "hold_s": 1.0, "idle_s": 3.0, "queue_depth": 0, "batches": 10},
                {"stage": 1, "hold_s": 3.0, "idle_s": 1.0, "queue_depth": 2, "batches": 10},
            ]
        }
        posted = Client().post(
            f"/api/rings/{plan.pk}/stats", body, content_type="application/json", **_auth(bridge.token)
        )
        assert posted.status_code == 200 and posted.json() == {"updated": 2}
        shown = Client().get(f"/api/rings/{plan.pk}/stats", **_auth(head.token)).json()
        assert [(s["stage"], s["hold_s"], s["idle_s"], s["queue_depth"], s["hold_share"]) for s in shown["stages"]] == [
            (0, 1.0, 3.0, 0, 0.25),
            (1, 3.0, 1.0, 2, 0.75),
        ]

    def test_it_refuses_a_host_outside_the_ring(
        self, plan_and_hosts: tuple[RingPlan, ServingHost, ServingHost, ServingHost]
    ) -> None:
        plan, *_ = plan_and_hosts
        outsider = make_host(name="outsider")
        body = {"stages": [{"stage": 0, "hold_s": 1.0, "idle_s": 3.0, "queue_depth": 0}]}
        posted = Client().post(
            f"/api/rings/{plan.pk}/stats", body, content_type="application/json", **_auth(outsider.token)
        )
        assert posted.status_code == 404
        assert Client().get(f"/api/rings/{plan.pk}/stats", **_auth(outsider.token)).status_code == 404

    def test_it_rejects_a_malformed_report(
        self, plan_and_hosts: tuple[RingPlan, ServingHost, ServingHost, ServingHost]
    ) -> None:
        plan, *_, bridge = plan_and_hosts
        body = {"stages": [{"stage": 0, "hold_s": -1.0, "idle_s": 3.0, "queue_depth": 0}]}
        answer = Client().post(
            f"/api/rings/{plan.pk}/stats", body, content_type="application/json", **_auth(bridge.token)
        )
        assert answer.status_code == 400


class RingAddressApiTests:
    def test_a_stage_host_reports_its_address_and_only_participants_read_them(
        self, plan_and_hosts: tuple[RingPlan, ServingHost, ServingHost, ServingHost], settings
    ) -> None:
        settings.RING_ALLOW_PRIVATE_STAGES = (
            True  # the operator's local test rings (strangers' rings dial public addresses only)
        )
        plan, head, tail, bridge = plan_and_hosts
        url = f"/api/rings/{plan.pk}/stages/1/address"
        posted = Client().post(url, {"address": "10.1.2.3:7001"}, content_type="application/json", **_auth(tail.token))
        assert posted.status_code == 200 and posted.json()["address"] == "10.1.2.3:7001"
        refused = Client().post(url, {"address": "10.1.2.3:7001"}, content_type="application/json", **_auth(head.token))
        assert (refused.status_code, refused.json()["error"]["code"]) == (403, "not_your_stage")
        bad = Client().post(url, {"address": "0.0.0.0:7001"}, content_type="application/json", **_auth(tail.token))
        assert (bad.status_code, bad.json()["error"]["code"]) == (400, "address_invalid")
        shown = Client().get(f"/api/rings/{plan.pk}/addresses", **_auth(bridge.token)).json()
        assert [(s["stage"], s["address"]) for s in shown["stages"]] == [(0, ""), (1, "10.1.2.3:7001")]
        outsider = make_host(name="outsider")
        assert Client().get(f"/api/rings/{plan.pk}/addresses", **_auth(outsider.token)).status_code == 404
        assert (
            Client()
            .post(url, {"address": "10.9.9.9:1"}, content_type="application/json", **_auth(outsider.token))
            .status_code
            == 404
        )


class RingStageLeaveApiTests:
    def test_a_stage_host_clears_the_address_it_left_and_nobody_else_can(
        self, plan_and_hosts: tuple[RingPlan, ServingHost, ServingHost, ServingHost], settings
    ) -> None:
        settings.RING_ALLOW_PRIVATE_STAGES = True
        plan, head, tail, bridge = plan_and_hosts
        Client().post(
            f"/api/rings/{plan.pk}/stages/1/address",
            {"address": "10.1.2.3:7001"},
            content_type="application/json",
            **_auth(tail.token),
        )
        url = f"/api/rings/{plan.pk}/stages/1/leave"
        refused = Client().post(url, {"address": "10.1.2.3:7001"}, content_type="application/json", **_auth(head.token))
        assert (refused.status_code, refused.json()["error"]["code"]) == (403, "not_your_stage")
        assert Client().post(url, {}, content_type="application/json", **_auth(tail.token)).status_code == 400
        left = Client().post(url, {"address": "10.1.2.3:7001"}, content_type="application/json", **_auth(tail.token))
        assert left.status_code == 200 and left.json() == {"cleared": True}
        shown = Client().get(f"/api/rings/{plan.pk}/addresses", **_auth(bridge.token)).json()
        assert [(s["stage"], s["address"]) for s in shown["stages"]] == [(0, ""), (1, "")]


class RingSecretApiTests:
    def test_each_link_has_its_own_secret_handed_to_its_two_ends_only(
        self, plan_and_hosts: tuple[RingPlan, ServingHost, ServingHost, ServingHost]
    ) -> None:
        plan, head, tail, bridge = plan_and_hosts
        url = f"/api/rings/{plan.pk}/secret"
        bridge_links = Client().get(url, **_auth(bridge.token)).json()
        (head_links,) = [
            a["links"] for a in Client().get("/api/rings/assignment", **_auth(head.token)).json()["assignments"]
        ]
        (tail_links,) = [
            a["links"] for a in Client().get("/api/rings/assignment", **_auth(tail.token)).json()["assignments"]
        ]
        assert head_links["downstream"] == {"stage": 1, "secret": tail_links["upstream"]["secret"]}  # head -> tail
        assert tail_links["downstream"] == {"stage": 0, "secret": head_links["upstream"]["secret"]}  # tail -> head
        assert (head_links["bridge"], tail_links["bridge"]) == (bridge_links["head"], bridge_links["tail"])
        secrets = [
            head_links["downstream"]["secret"],
            tail_links["downstream"]["secret"],
            bridge_links["head"],
            bridge_links["tail"],
        ]
        assert len(set(secrets)) == 4 and all(len(s) >= 32 for s in secrets)
        everything = " ".join(
            Client().get(u, **_auth(who.token)).content.decode()
            for u in (url, "/api/rings/assignment")
            for who in (head, tail, bridge)
        )
        assert plan.secret not in everything  # what they are derived from never leaves the gateway
        for stage_host in (head, tail):  # a stage host is not handed the bridge's links
            refused = Client().get(url, **_auth(stage_host.token))
            assert (refused.status_code, refused.json()["error"]["code"]) == (403, "not_the_bridge")
        outsider = make_host(name="outsider")
        refused = Client().get(url, **_auth(outsider.token))
        assert refused.status_code == 404 and bridge_links["head"] not in refused.content.decode()
        assert Client().get(url).status_code == 401

    def test_every_plan_has_its_own_and_a_retired_one_hands_out_none(
        self, plan_and_hosts: tuple[RingPlan, ServingHost, ServingHost, ServingHost]
    ) -> None:
        plan, head, tail, bridge = plan_and_hosts
        other = ring_plan_create(
            model_name="gemma-3-270m",
            stages=[StageSpec(0, 9, head.host), StageSpec(9, 18, tail.host)],
            row_width=64,
            micro_batch=4,
            bridge_host=bridge.host,
        )
        assert other.secret != plan.secret
        mine, theirs = (Client().get(f"/api/rings/{p.pk}/secret", **_auth(bridge.token)).json() for p in (plan, other))
        assert mine["head"] != theirs["head"] and mine["tail"] != theirs["tail"]
        RingPlan.objects.filter(pk=plan.pk).update(status=RingPlan.Status.RETIRED)
        answer = Client().get(f"/api/rings/{plan.pk}/secret", **_auth(bridge.token))
        assert (answer.status_code, answer.json()["error"]["code"]) == (409, "ring_retired")


class RingRelayDialTests:
    def test_only_a_stages_neighbours_may_dial_it_through_the_relay(self, catalog: CatalogModel) -> None:
        from catalog.models import CatalogModel
        from mesh.rings.selectors import relay_dial_allowed

        layout_seed(CatalogModel, ModelLayout)
        a, b, c, bridge = (make_host(name=name) for name in ("a", "b", "c", "bridge"))
        plan = ring_plan_create(
            model_name="gemma-3-270m",
            row_width=64,
            micro_batch=4,
            bridge_host=bridge.host,
            stages=[StageSpec(0, 6, a.host), StageSpec(6, 12, b.host), StageSpec(12, 18, c.host)],
        )

        def allowed(index: int) -> set[str]:
            return {
                who.host.name
                for who in (a, b, c, bridge)
                if relay_dial_allowed(plan_id=plan.pk, index=index, host_id=who.host.pk)
            }

        assert allowed(0) == {"c", "bridge"}  # the tail closes the ring; the bridge feeds the head
        assert allowed(1) == {"a"}  # never the bridge, nor stage 2
        assert allowed(2) == {"b", "bridge"}
        assert allowed(3) == set()
        RingPlan.objects.filter(pk=plan.pk).update(status=RingPlan.Status.RETIRED)
        assert allowed(0) == set()
