"""The ring API: hosts pull their assignment and report / read stage time use; the ring's
secret goes to its participants only."""
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
        model_name="gemma-3-270m", stages=[StageSpec(0, 9, head.host), StageSpec(9, 18, tail.host)],
        row_width=64, micro_batch=4, bridge_host=bridge.host,
    )
    return plan, head, tail, bridge


def _auth(token: str) -> dict:
    return {"HTTP_AUTHORIZATION": f"Bearer {token}"}


class RingAssignmentApiTests:
    def test_it_hands_a_stage_host_its_layer_range_and_the_plan(self, plan_and_hosts: tuple[RingPlan, ServingHost, ServingHost, ServingHost]) -> None:
        plan, head, tail, _ = plan_and_hosts
        answer = Client().get("/api/rings/assignment", **_auth(tail.token))
        assert answer.status_code == 200
        (assignment,) = answer.json()["assignments"]
        assert assignment["ring"] == plan.pk and assignment["model"] == "gemma-3-270m"
        assert (assignment["stage"], assignment["start"], assignment["end"]) == (1, 9, 18)
        assert (assignment["row_width"], assignment["micro_batch"]) == (64, 4)
        assert [(s["start"], s["end"]) for s in assignment["stages"]] == [(0, 9), (9, 18)]

    def test_it_refuses_an_outsider(self, plan_and_hosts: tuple[RingPlan, ServingHost, ServingHost, ServingHost]) -> None:
        assert Client().get("/api/rings/assignment").status_code == 401
        assert Client().get("/api/rings/assignment", **_auth("host_nope")).status_code == 401


class RingStatsApiTests:
    def test_it_shows_what_the_bridge_reported_for_every_stage(self, plan_and_hosts: tuple[RingPlan, ServingHost, ServingHost, ServingHost]) -> None:
        plan, head, _, bridge = plan_and_hosts
        body = {"stages": [
            {"stage": 0, "hold_s": 1.0, "idle_s": 3.0, "queue_depth": 0, "batches": 10},
            {"stage": 1, "hold_s": 3.0, "idle_s": 1.0, "queue_depth": 2, "batches": 10},
        ]}
        posted = Client().post(f"/api/rings/{plan.pk}/stats", body, content_type="application/json", **_auth(bridge.token))
        assert posted.status_code == 200 and posted.json() == {"updated": 2}
        shown = Client().get(f"/api/rings/{plan.pk}/stats", **_auth(head.token)).json()
        assert [(s["stage"], s["hold_s"], s["idle_s"], s["queue_depth"], s["hold_share"]) for s in shown["stages"]] == [
            (0, 1.0, 3.0, 0, 0.25), (1, 3.0, 1.0, 2, 0.75)
        ]

    def test_it_refuses_a_host_outside_the_ring(self, plan_and_hosts: tuple[RingPlan, ServingHost, ServingHost, ServingHost]) -> None:
        plan, *_ = plan_and_hosts
        outsider = make_host(name="outsider")
        body = {"stages": [{"stage": 0, "hold_s": 1.0, "idle_s": 3.0, "queue_depth": 0}]}
        posted = Client().post(f"/api/rings/{plan.pk}/stats", body, content_type="application/json", **_auth(outsider.token))
        assert posted.status_code == 404
        assert Client().get(f"/api/rings/{plan.pk}/stats", **_auth(outsider.token)).status_code == 404

    def test_it_rejects_a_malformed_report(self, plan_and_hosts: tuple[RingPlan, ServingHost, ServingHost, ServingHost]) -> None:
        plan, *_, bridge = plan_and_hosts
        body = {"stages": [{"stage": 0, "hold_s": -1.0, "idle_s": 3.0, "queue_depth": 0}]}
        answer = Client().post(f"/api/rings/{plan.pk}/stats", body, content_type="application/json", **_auth(bridge.token))
        assert answer.status_code == 400


class RingAddressApiTests:
    def test_a_stage_host_reports_its_address_and_only_participants_read_them(self, plan_and_hosts: tuple[RingPlan, ServingHost, ServingHost, ServingHost], settings) -> None:
        settings.RING_ALLOW_PRIVATE_STAGES = True  # the operator's local test rings (strangers' rings dial public addresses only)
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
        assert Client().post(url, {"address": "10.9.9.9:1"}, content_type="application/json",
                             **_auth(outsider.token)).status_code == 404


class RingStageLeaveApiTests:
    def test_a_stage_host_clears_the_address_it_left_and_nobody_else_can(self, plan_and_hosts: tuple[RingPlan, ServingHost, ServingHost, ServingHost], settings) -> None:
        settings.RING_ALLOW_PRIVATE_STAGES = True
        plan, head, tail, bridge = plan_and_hosts
        Client().post(f"/api/rings/{plan.pk}/stages/1/address", {"address": "10.1.2.3:7001"}, content_type="application/json",
                      **_auth(tail.token))
        url = f"/api/rings/{plan.pk}/stages/1/leave"
        refused = Client().post(url, {"address": "10.1.2.3:7001"}, content_type="application/json", **_auth(head.token))
        assert (refused.status_code, refused.json()["error"]["code"]) == (403, "not_your_stage")
        assert Client().post(url, {}, content_type="application/json", **_auth(tail.token)).status_code == 400
        left = Client().post(url, {"address": "10.1.2.3:7001"}, content_type="application/json", **_auth(tail.token))
        assert left.status_code == 200 and left.json() == {"cleared": True}
        shown = Client().get(f"/api/rings/{plan.pk}/addresses", **_auth(bridge.token)).json()
        assert [(s["stage"], s["address"]) for s in shown["stages"]] == [(0, ""), (1, "")]


class RingSecretApiTests:
    def test_only_the_rings_participants_are_handed_its_secret(self, plan_and_hosts: tuple[RingPlan, ServingHost, ServingHost, ServingHost]) -> None:
        plan, head, tail, bridge = plan_and_hosts
        url = f"/api/rings/{plan.pk}/secret"
        shown = {Client().get(url, **_auth(who.token)).json()["secret"] for who in (head, tail, bridge)}
        assert shown == {plan.secret} and len(plan.secret) >= 32
        (assignment,) = Client().get("/api/rings/assignment", **_auth(tail.token)).json()["assignments"]
        assert assignment["secret"] == plan.secret
        outsider = make_host(name="outsider")
        refused = Client().get(url, **_auth(outsider.token))
        assert refused.status_code == 404 and plan.secret not in refused.content.decode()
        assert Client().get(url).status_code == 401

    def test_every_plan_has_its_own_and_a_retired_one_hands_out_none(self, plan_and_hosts: tuple[RingPlan, ServingHost, ServingHost, ServingHost]) -> None:
        plan, head, tail, bridge = plan_and_hosts
        other = ring_plan_create(model_name="gemma-3-270m", stages=[StageSpec(0, 9, head.host), StageSpec(9, 18, tail.host)],
                                 row_width=64, micro_batch=4, bridge_host=bridge.host)
        assert other.secret != plan.secret
        RingPlan.objects.filter(pk=plan.pk).update(status=RingPlan.Status.RETIRED)
        answer = Client().get(f"/api/rings/{plan.pk}/secret", **_auth(bridge.token))
        assert (answer.status_code, answer.json()["error"]["code"]) == (409, "ring_retired")
