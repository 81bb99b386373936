"""A ring's failed audit finds the host at fault before anyone is punished (issue 29,
`marketplace.trust.ring_inquiries`): the customer is refunded at once; each stage host hands over
its evidence over the host API, in parts; a trusted host outside the ring (of another owner)
claims the check through the claim path, reads the evidence and names the stage; only that
stage's host goes into maintenance, and the checker is paid. Stages that stay silent are
checked as having kept nothing; with no checker the bridge is blamed, as before; a silent
checker loses the check. Strangers and other stages are refused in the API's format."""

from __future__ import annotations

import base64
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from billing import selectors as ledger
from conftest import make_host
from hosts.models import Host
from marketplace.models import Audit, RingEvidence, RingInquiry
from marketplace.tests.test_ring_audits import _tokens, ring, serve  # noqa: F401 - `ring` is a fixture
from marketplace.tests.test_ring_pay import host_earned
from marketplace.trust import audits, ring_inquiries
from protocol.jobs import RING_CHECK

pytestmark = [pytest.mark.django_db, pytest.mark.audits]


def failed(customer, catalog, ring) -> RingInquiry:  # noqa: ANN001, F811
    bridge = ring[0]
    audit = Audit.objects.get(job=serve(customer, catalog, bridge))
    assert audits.audit_decide(audit=audit, reason="token 2 is not the seed's draw", counts={"misses": 3})
    return RingInquiry.objects.get(audit=audit)


def call(method: str, path: str, token: str, body: dict | None = None):  # noqa: ANN201
    client = Client()
    auth = {"HTTP_AUTHORIZATION": f"Bearer {token}"}
    if method == "GET":
        return client.get(f"/hosts/api{path}", **auth)
    return client.post(f"/hosts/api{path}", body or {}, content_type="application/json", **auth)


def hand_over(inquiry: RingInquiry, stage: int, token: str, data: bytes, part_bytes: int = 5) -> None:
    chunks = [data[i : i + part_bytes] for i in range(0, len(data), part_bytes)] or [b""]
    for part, chunk in enumerate(chunks):
        answer = call(
            "POST",
            f"/ring-inquiries/{inquiry.pk}/evidence",
            token,
            {
                "stage": stage,
                "part": part,
                "parts": len(chunks) if data else 0,
                "data": base64.b64encode(chunk).decode(),
            },
        )
        assert answer.status_code == 200, answer.content


def test_every_stage_hands_over_its_evidence_a_checker_outside_the_ring_names_the_stage_and_only_it_is_blamed(
    customer, catalog, ring  # noqa: F811
) -> None:  # noqa: ANN001, F811
    bridge, first, last = ring
    inquiry = failed(customer, catalog, ring)
    wanted = call("GET", f"/ring-inquiries?ring={inquiry.plan_id}&stage=0", first.token).json()["inquiries"]
    assert wanted == [{"id": inquiry.pk, "job": inquiry.audit.job_id}]
    hand_over(inquiry, 0, first.token, b"stage zero's npz bytes")  # five parts of five bytes
    assert call("GET", f"/ring-inquiries?ring={inquiry.plan_id}&stage=0", first.token).json()["inquiries"] == []
    hand_over(inquiry, 1, bridge.token, b"the bridge's own stage")  # a stage without a host is the bridge's
    inquiry.refresh_from_db()
    assert inquiry.status == RingInquiry.Status.COLLECTING
    hand_over(inquiry, 2, last.token, b"")  # the tail kept nothing
    inquiry.refresh_from_db()
    assert inquiry.status == RingInquiry.Status.CHECKING

    participant = make_host(name="bridge's twin", trusted=True)
    Host.objects.filter(pk=participant.host.pk).update(
        owner=bridge.host.owner
    )  # same owner as the bridge: never checks
    assert (
        ring_inquiries.inquiry_claim_payload(host=Host.objects.get(pk=participant.host.pk), model_ids=[catalog.pk])
        is None
    )
    assert (
        ring_inquiries.inquiry_claim_payload(host=make_host(name="new").host, model_ids=[catalog.pk]) is None
    )  # probation
    checker = make_host(name="checker", trusted=True)
    payload = ring_inquiries.inquiry_claim_payload(host=checker.host, model_ids=[catalog.pk])
    assert payload is not None and payload["kind"] == RING_CHECK and payload["tokens"] == _tokens(catalog)
    assert "id" not in payload["job"] and payload["job"]["params"]["seed"] == 7
    assert [(s["index"], s["parts"]) for s in payload["stages"]] == [(0, 5), (1, 5), (2, 0)]
    part = call("GET", f"/ring-inquiries/{inquiry.pk}/evidence?stage=0&part=1", checker.token)
    assert base64.b64decode(part.json()["data"]) == b" zero"
    assert (
        call("GET", f"/ring-inquiries/{inquiry.pk}/evidence?stage=0&part=1", first.token).status_code == 409
    )  # not its check

    passed = Audit.objects.get(job=serve(customer, catalog, bridge))  # (a passed job leaves the platform its share)
    assert audits.audit_decide(audit=passed, reason=None, counts={"checked": 4})
    answer = call(
        "POST",
        f"/ring-inquiries/{inquiry.pk}/verdict",
        checker.token,
        {"verdict": "blamed", "blamed": [2], "reasons": ["stage 2 kept no evidence of the request"]},
    )
    assert answer.status_code == 200 and answer.json() == {"status": "decided"}
    hosts = {h.pk: h for h in Host.objects.filter(pk__in=[h.host.pk for h in ring])}
    assert hosts[last.host.pk].maintenance_by == "verification"
    assert "stage 2 of ring" in hosts[last.host.pk].maintenance_reason
    assert hosts[bridge.host.pk].maintenance_since is None and hosts[first.host.pk].maintenance_since is None
    inquiry.refresh_from_db()
    assert (
        inquiry.blamed == [{"stage": 2, "host": last.host.pk}] and inquiry.payload is None and inquiry.token_ids is None
    )
    assert not RingEvidence.objects.filter(inquiry=inquiry).exists()  # the hidden states of the prompt are gone
    assert host_earned(checker.host) > 0  # paid its fee, out of the platform's revenue
    assert ledger.reconcile_report() == []


def test_the_bridge_blamed_by_the_checker_is_the_one_punished(customer, catalog, ring) -> None:  # noqa: ANN001, F811
    bridge, first, last = ring
    inquiry = failed(customer, catalog, ring)
    for stage, who in ((0, first), (1, bridge), (2, last)):
        hand_over(inquiry, stage, who.token, b"x" * 12)
    checker = make_host(name="checker", trusted=True)
    assert ring_inquiries.inquiry_claim_payload(host=checker.host, model_ids=[catalog.pk])["id"] == inquiry.pk
    assert (
        ring_inquiries.inquiry_verdict_report(
            host=checker.host,
            inquiry_id=inquiry.pk,
            verdict="blamed",
            blamed=[ring_inquiries.BRIDGE, 1],
            reasons=["changed a token"],
        )
        == "decided"
    )
    reasons = Host.objects.get(pk=bridge.host.pk).maintenance_reason
    assert "the bridge, stage 1 of ring" in reasons  # its own stage and its bridge: one host, blamed once
    assert not Host.objects.filter(pk__in=[first.host.pk, last.host.pk], maintenance_since__isnull=False).exists()


def test_silent_stages_are_checked_as_having_kept_nothing_and_with_no_checker_the_bridge_is_blamed(
    customer, catalog, ring, settings  # noqa: F811
) -> None:  # noqa: ANN001, F811
    bridge, first, _ = ring
    inquiry = failed(customer, catalog, ring)
    hand_over(inquiry, 0, first.token, b"only the head answered")
    later = timezone.now() + timedelta(seconds=settings.RING_EVIDENCE_WAIT_SECONDS + 1)
    assert ring_inquiries.inquiries_watch(now=later) == 0
    inquiry.refresh_from_db()
    assert inquiry.status == RingInquiry.Status.CHECKING
    checker = make_host(name="checker", trusted=True)
    payload = ring_inquiries.inquiry_claim_payload(host=checker.host, model_ids=[catalog.pk])
    assert [s["parts"] for s in payload["stages"]] == [5, 0, 0]
    silent = timezone.now() + timedelta(seconds=settings.AUDIT_SCORE_TIMEOUT_SECONDS + 1)
    ring_inquiries.inquiries_watch(now=silent)  # the checker said nothing: it loses the check, and is not asked again
    inquiry.refresh_from_db()
    assert inquiry.checker_id is None and inquiry.declined_by == [checker.host.pk]
    assert ring_inquiries.inquiry_claim_payload(host=checker.host, model_ids=[catalog.pk]) is None
    nobody = timezone.now() + timedelta(seconds=settings.AUDIT_SCORER_WAIT_SECONDS + 1)
    assert ring_inquiries.inquiries_watch(now=nobody) == 1
    inquiry.refresh_from_db()
    assert inquiry.status == RingInquiry.Status.DECIDED and inquiry.blamed == [{"stage": -1, "host": bridge.host.pk}]
    assert Host.objects.get(pk=bridge.host.pk).maintenance_by == "verification"


def test_strangers_other_stages_and_bad_parts_are_refused_in_the_apis_format(customer, catalog, ring) -> None:  # noqa: ANN001, F811
    bridge, first, last = ring
    inquiry = failed(customer, catalog, ring)
    stranger = make_host(name="stranger")
    assert call("GET", f"/ring-inquiries?ring={inquiry.plan_id}&stage=0", stranger.token).status_code == 404
    assert (
        call("GET", f"/ring-inquiries?ring={inquiry.plan_id}&stage=2", first.token).status_code == 404
    )  # not its stage
    assert call("GET", "/ring-inquiries?ring=x&stage=0", first.token).status_code == 400
    post = f"/ring-inquiries/{inquiry.pk}/evidence"
    refused = call("POST", post, last.token, {"stage": 0, "part": 0, "parts": 1, "data": ""})
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "inquiry_not_found"
    for data in ("not base64!", "éé00"):
        bad = call("POST", post, first.token, {"stage": 0, "part": 0, "parts": 1, "data": data})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "data"
    beyond = call("POST", post, first.token, {"stage": 0, "part": 3, "parts": 2, "data": ""})
    assert beyond.status_code == 400 and beyond.json()["error"]["code"] == "invalid_part"
    assert call("POST", post, first.token, {"stage": 0, "part": 0, "parts": 2, "data": "eHg="}).status_code == 200
    changed = call("POST", post, first.token, {"stage": 0, "part": 1, "parts": 3, "data": "eHg="})
    assert changed.status_code == 409 and changed.json()["error"]["code"] == "parts_changed"
    verdict = call(
        "POST", f"/ring-inquiries/{inquiry.pk}/verdict", stranger.token, {"verdict": "blamed", "blamed": [0]}
    )
    assert verdict.status_code == 409  # nobody's check yet, and never a stranger's
    for stage, who in ((1, bridge), (2, last)):
        hand_over(inquiry, stage, who.token, b"")
    hand_over(inquiry, 0, first.token, b"xxxxxxxxxx")
    checker = make_host(name="checker", trusted=True)
    ring_inquiries.inquiry_claim_payload(host=checker.host, model_ids=[catalog.pk])
    outside = call("POST", f"/ring-inquiries/{inquiry.pk}/verdict", checker.token, {"verdict": "blamed", "blamed": [7]})
    assert outside.status_code == 400 and outside.json()["error"]["code"] == "invalid_blame"
    declined = call(
        "POST",
        f"/ring-inquiries/{inquiry.pk}/verdict",
        checker.token,
        {"verdict": "declined", "reasons": ["the file is not here"]},
    )
    assert declined.json() == {"status": "checking"}
    assert not Host.objects.filter(pk__in=[h.host.pk for h in ring], maintenance_since__isnull=False).exists()


def test_where_a_second_checker_can_look_two_must_agree_and_one_outvoted_loses_its_trust(
    customer, catalog, ring  # noqa: F811
) -> None:  # noqa: ANN001, F811
    bridge, first, last = ring
    inquiry = failed(customer, catalog, ring)
    for stage, who in ((0, first), (1, bridge), (2, last)):
        hand_over(inquiry, stage, who.token, b"x" * 12)
    liar, honest, third = (make_host(name=name, trusted=True) for name in ("liar", "honest", "third"))
    assert ring_inquiries.inquiry_claim_payload(host=liar.host, model_ids=[catalog.pk])["id"] == inquiry.pk
    assert (
        ring_inquiries.inquiry_verdict_report(
            host=liar.host, inquiry_id=inquiry.pk, verdict="blamed", blamed=[0], reasons=["framed"]
        )
        == "checking"
    )  # others could look: it waits
    assert ring_inquiries.inquiry_claim_payload(host=liar.host, model_ids=[catalog.pk]) is None  # not twice
    assert ring_inquiries.inquiry_claim_payload(host=honest.host, model_ids=[catalog.pk])["id"] == inquiry.pk
    assert (
        ring_inquiries.inquiry_verdict_report(
            host=honest.host, inquiry_id=inquiry.pk, verdict="blamed", blamed=[2], reasons=["stage 2's layers differ"]
        )
        == "checking"
    )  # split: a third
    assert ring_inquiries.inquiry_claim_payload(host=third.host, model_ids=[catalog.pk])["id"] == inquiry.pk
    assert (
        ring_inquiries.inquiry_verdict_report(
            host=third.host, inquiry_id=inquiry.pk, verdict="blamed", blamed=[2], reasons=["stage 2's layers differ"]
        )
        == "decided"
    )
    hosts = {h.pk: h for h in Host.objects.filter(pk__in=[h.host.pk for h in (first, last, liar, honest, third)])}
    assert hosts[last.host.pk].maintenance_by == "verification" and hosts[first.host.pk].maintenance_since is None
    assert hosts[liar.host.pk].trusted_at is None  # outvoted: it checks no more
    assert hosts[honest.host.pk].trusted_at is not None and hosts[third.host.pk].trusted_at is not None


def test_a_lone_verdict_stands_when_no_second_look_comes_in_time(customer, catalog, ring, settings) -> None:  # noqa: ANN001, F811
    bridge, first, last = ring
    inquiry = failed(customer, catalog, ring)
    for stage, who in ((0, first), (1, bridge), (2, last)):
        hand_over(inquiry, stage, who.token, b"x" * 12)
    one, _other = make_host(name="one", trusted=True), make_host(name="other", trusted=True)
    ring_inquiries.inquiry_claim_payload(host=one.host, model_ids=[catalog.pk])
    assert (
        ring_inquiries.inquiry_verdict_report(
            host=one.host, inquiry_id=inquiry.pk, verdict="blamed", blamed=[0], reasons=["stage 0's layers differ"]
        )
        == "checking"
    )
    later = timezone.now() + timedelta(seconds=settings.AUDIT_SCORER_WAIT_SECONDS + 1)
    assert ring_inquiries.inquiries_watch(now=later) == 1
    inquiry.refresh_from_db()
    assert inquiry.status == RingInquiry.Status.DECIDED and inquiry.blamed == [{"stage": 0, "host": first.host.pk}]
    assert Host.objects.get(pk=first.host.pk).maintenance_by == "verification"


def test_the_pool_page_counts_the_inquiries_open_and_decided(customer, catalog, ring, settings) -> None:  # noqa: ANN001, F811
    from django.contrib.auth import get_user_model

    staff = get_user_model().objects.create_user(username="ops@example.com", password="x" * 12, is_staff=True)
    client = Client()
    client.force_login(staff)
    assert "data-ring-inquiries" not in client.get("/pool/").content.decode()
    inquiry = failed(customer, catalog, ring)
    assert "looked into: 1 open, 0 decided" in client.get("/pool/").content.decode()
    later = timezone.now() + timedelta(
        seconds=settings.RING_EVIDENCE_WAIT_SECONDS + settings.AUDIT_SCORER_WAIT_SECONDS + 1
    )
    ring_inquiries.inquiries_watch(now=later)
    ring_inquiries.inquiries_watch(now=later + timedelta(seconds=settings.AUDIT_SCORER_WAIT_SECONDS + 1))
    assert RingInquiry.objects.get(pk=inquiry.pk).status == RingInquiry.Status.DECIDED
    assert "looked into: 0 open, 1 decided" in client.get("/pool/").content.decode()


def _checked(customer, catalog, ring):  # noqa: ANN001, ANN202, F811
    """A failed audit of a job the ring served after a passed one (so its stage hosts have
    unvested earnings to lose), every stage's evidence handed over, a checker on it."""
    bridge, first, last = ring
    passed = Audit.objects.get(job=serve(customer, catalog, bridge))
    assert audits.audit_decide(audit=passed, reason=None, counts={"checked": 4})
    inquiry = failed(customer, catalog, ring)
    for stage, who in ((0, first), (1, bridge), (2, last)):
        hand_over(inquiry, stage, who.token, b"x" * 12)
    checker = make_host(name="checker", trusted=True)
    assert ring_inquiries.inquiry_claim_payload(host=checker.host, model_ids=[catalog.pk])["id"] == inquiry.pk
    return inquiry, checker


def test_a_link_dispute_alone_forfeits_nothing_retires_the_ring_and_keeps_the_pair_apart(
    customer, catalog, ring  # noqa: F811
) -> None:  # noqa: ANN001, F811
    """Issue 50: the tail says it sent the head other tokens than the head says it ran. One of
    the two lies and nobody can tell which: neither is put in maintenance nor loses a micro-cent."""
    from mesh.rings.models import RingLinkDispute, RingPlan
    from mesh.rings.services import PlanInvalid, StageSpec, ring_plan_create

    bridge, first, last = ring
    inquiry, checker = _checked(customer, catalog, ring)
    earned = {who.host.pk: host_earned(who.host) for who in ring}
    assert earned[first.host.pk] > 0 and earned[last.host.pk] > 0  # something a forfeit would take
    answer = call(
        "POST",
        f"/ring-inquiries/{inquiry.pk}/verdict",
        checker.token,
        {
            "verdict": "blamed",
            "blamed": [],
            "disputed": [[2, 0]],
            "reasons": [
                "disputed link (neither end blamed for it): the head ran token 5 at position 40, "
                "the tail says it drew 6"
            ],
        },
    )
    assert answer.status_code == 200 and answer.json() == {"status": "decided"}, answer.content
    hosts = Host.objects.filter(pk__in=[h.host.pk for h in ring])
    assert [h.maintenance_since for h in hosts] == [None, None, None]
    assert {who.host.pk: host_earned(who.host) for who in ring} == earned  # nobody forfeited anything
    inquiry.refresh_from_db()
    assert inquiry.status == RingInquiry.Status.DECIDED and inquiry.blamed == []
    assert host_earned(checker.host) > 0  # the check was done, and paid
    (dispute,) = RingLinkDispute.objects.all()
    assert (dispute.upstream_index, dispute.downstream_index) == (2, 0)
    assert (dispute.upstream_host_id, dispute.downstream_host_id) == (last.host.pk, first.host.pk)
    assert RingPlan.objects.get(pk=inquiry.plan_id).status == RingPlan.Status.RETIRED  # to be planned again
    n_layers = inquiry.plan.n_layers
    with pytest.raises(PlanInvalid, match="disagreed"):  # not neighbours again, either way round
        ring_plan_create(
            model_name=catalog.name,
            row_width=64,
            micro_batch=2,
            bridge_host=bridge.host,
            stages=[StageSpec(0, 2, first.host), StageSpec(2, n_layers, last.host)],
        )
    q = n_layers // 4  # four stages: the head (first) and stage 2 (last) share no link (the bridge runs 1 and 3)
    apart = ring_plan_create(
        model_name=catalog.name,
        row_width=64,
        micro_batch=2,
        bridge_host=bridge.host,
        stages=[
            StageSpec(0, q, first.host),
            StageSpec(q, 2 * q, None),
            StageSpec(2 * q, 3 * q, last.host),
            StageSpec(3 * q, n_layers, None),
        ],
    )
    assert apart.status == RingPlan.Status.ACTIVE
    assert ledger.reconcile_report() == []


def test_a_dispute_the_ends_owner_lied_in_either_way_blames_both_and_a_blamed_end_still_forfeits(
    customer, catalog, ring  # noqa: F811
) -> None:  # noqa: ANN001, F811
    bridge, first, last = ring
    Host.objects.filter(pk=last.host.pk).update(owner=first.host.owner)  # one owner at both ends of link 2 -> 0
    inquiry, checker = _checked(customer, catalog, ring)
    assert (
        ring_inquiries.inquiry_verdict_report(
            host=checker.host,
            inquiry_id=inquiry.pk,
            verdict="blamed",
            blamed=[],
            disputed=[[2, 0]],
            reasons=["disputed"],
        )
        == "decided"
    )
    assert set(Host.objects.filter(maintenance_by="verification").values_list("pk", flat=True)) == {
        first.host.pk,
        last.host.pk,
    }
    inquiry.refresh_from_db()
    assert sorted(entry["stage"] for entry in inquiry.blamed) == [0, 2]


def test_a_verdict_must_name_a_stage_or_a_link_of_the_ring(customer, catalog, ring) -> None:  # noqa: ANN001, F811
    inquiry, checker = _checked(customer, catalog, ring)
    url = f"/ring-inquiries/{inquiry.pk}/verdict"
    for body, code in (
        ({"verdict": "blamed"}, "invalid_blame"),
        ({"verdict": "blamed", "disputed": [[0, 2]]}, "invalid_dispute"),
        ({"verdict": "blamed", "disputed": [[-1, 1]]}, "invalid_dispute"),
    ):
        refused = call("POST", url, checker.token, body)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == code, refused.content
    short = call("POST", url, checker.token, {"verdict": "blamed", "disputed": [[0]]})
    assert short.status_code == 400 and short.json()["error"]["param"].startswith("disputed")
    assert call("POST", url, checker.token, {"verdict": "blamed", "disputed": [[-1, 0]]}).json() == {
        "status": "decided"
    }
