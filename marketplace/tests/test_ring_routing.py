"""A ring serves what a single machine does: a `response_format`'s grammar, top_p < 1,
log-probabilities, and (mahout 0.7.0) a continuation under a grammar, whose delivered text the
ring's picking stage writes again under the grammar before it goes on (`rewrite`). So every job
of the model is routed to a ring's bridge as to any warm host. A bridge is never handed an
audit of its ring's model to score (it holds no llama.cpp model to read one with)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from conftest import make_customer, make_host
from marketplace import services as market
from marketplace.models import Job
from marketplace.tests.test_routing import beat
from mesh.rings.models import ModelLayout
from mesh.rings.services import StageSpec, ring_plan_create
from testkit.requests import submit_request

pytestmark = pytest.mark.django_db(transaction=True)  # (the claim door reads the database from another thread)

GRAMMAR = {"response_format": {"type": "json_object"}}


@pytest.fixture
def bridge(catalog):  # noqa: ANN001, ANN201
    """A warm host that serves the model through a two-stage ring it bridges (its own stages)."""
    serving = make_host(name="bridge")
    n_layers = ModelLayout.objects.get_or_create(model=catalog, defaults={"n_layers": 18})[
        0
    ].n_layers  # (flushed by an earlier test)
    ring_plan_create(
        model_name=catalog.name,
        row_width=64,
        micro_batch=2,
        bridge_host=serving.host,
        stages=[StageSpec(0, n_layers // 2, None), StageSpec(n_layers // 2, n_layers, None)],
    )
    beat(serving, loaded=[catalog.name], slots=4)
    return serving


@pytest.fixture
def whole(catalog):  # noqa: ANN001, ANN201
    """A warm host holding the whole model."""
    serving = make_host(name="whole", fingerprint="e" * 64)
    beat(serving, loaded=[catalog.name])
    return serving


def lapse(job: Job) -> None:
    """Every offer and grace over: any host routing lets take it may claim it now."""
    past = timezone.now() - timedelta(seconds=1)
    Job.objects.filter(pk=job.pk).update(offer_until=past, warm_until=past)


def died_mid_answer(catalog, host, *, text: str) -> Job:  # noqa: ANN001
    """A grammar job `host` claimed, sent `text` of, and died on: the job that comes after it."""
    request = submit_request(make_customer(), catalog, max_tokens=16, prompt_tokens=3, stream=True, **GRAMMAR)
    first = Job.objects.get(request=request)
    lapse(first)
    Job.objects.filter(pk=first.pk).update(offered_host_id=host.host.pk)
    assert market.job_claim_next(host=host.host, fingerprint=host.fingerprint).pk == first.pk
    if text:
        market.job_push_tokens(host=host.host, job_id=first.pk, seq=0, text=text)
    market.host_connection_lost(host_id=host.host.pk)
    return Job.objects.filter(request=request).exclude(pk=first.pk).get()


@pytest.mark.parametrize(
    "asked", [GRAMMAR, {"top_p": 0.9}, {"logprobs": 2}], ids=["response_format", "top_p", "logprobs"]
)
def test_a_first_attempt_is_the_rings_whatever_it_asks(catalog, bridge, asked) -> None:  # noqa: ANN001
    job = Job.objects.get(request=submit_request(make_customer(), catalog, max_tokens=8, prompt_tokens=3, **asked))
    assert job.offered_host_id == bridge.host.pk
    assert market.job_claim_next(host=bridge.host, fingerprint=bridge.fingerprint).pk == job.pk


def test_a_continuation_under_a_grammar_goes_to_the_bridge_with_its_rewrite(catalog, bridge, whole) -> None:  # noqa: ANN001
    again = died_mid_answer(catalog, whole, text='{"animal": "ele')
    assert again.attempt == 2 and again.avoid_host_id == whole.host.pk
    assert again.offered_host_id == bridge.host.pk, "the bridge, the only live warm host, is offered it"
    claimed = market.job_claim_next(host=bridge.host, fingerprint=bridge.fingerprint)
    assert claimed.pk == again.pk
    assert market.job_payload(claimed)["rewrite"] == '{"animal": "ele'  # the ring writes it again under the grammar


def test_a_requeue_before_any_token_is_no_continuation_and_stays_the_rings(catalog, bridge, whole) -> None:  # noqa: ANN001
    again = died_mid_answer(catalog, whole, text="")
    assert again.attempt == 1 and "rewrite" not in market.job_payload(again)
    lapse(again)
    assert market.job_claim_next(host=bridge.host, fingerprint=bridge.fingerprint).pk == again.pk


def claim_door(serving) -> dict | None:  # noqa: ANN001
    """What the host's claim long-poll answers at once (`POST /hosts/api/claim`, no wait)."""
    answer = Client().post(
        "/hosts/api/claim",
        data=json.dumps({"fingerprint": serving.fingerprint, "wait": 0}),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {serving.token}",
    )
    assert answer.status_code in (200, 204), answer.content
    return answer.json()["job"] if answer.status_code == 200 else None  # (204: nothing for it now)


@pytest.mark.audits
def test_through_the_claim_door_the_bridge_gets_the_continuation_but_no_audit_of_its_ring_model(
    catalog, bridge, whole, settings
) -> None:  # noqa: ANN001
    from catalog.models import CatalogModel
    from marketplace.models import Audit
    from marketplace.trust.reputation import trust_grant
    from mesh.rings.models import RingPlan

    CatalogModel.objects.filter(pk=catalog.pk).update(
        weights_path="/nowhere/gone.gguf", tokenizer="bytes"
    )  # hosts score
    trust_grant(host_id=bridge.host.pk)
    again = died_mid_answer(catalog, whole, text="{")  # (unaudited: it died)
    lapse(again)
    settings.AUDIT_PROBATION_RATE = 1.0
    other = make_host(name="other", fingerprint="d" * 64)  # in probation: every job of it audited
    beat(other, loaded=[catalog.name])
    plain = Job.objects.get(
        request=submit_request(make_customer(), catalog, max_tokens=8, prompt_tokens=3, temperature=0.8)
    )
    Job.objects.filter(pk=plain.pk).update(offered_host_id=other.host.pk)
    assert market.job_claim_next(host=other.host, fingerprint=other.fingerprint).pk == plain.pk
    market.job_push_tokens(host=other.host, job_id=plain.pk, seq=0, text="Hello there.")
    market.job_complete(host=other.host, job_id=plain.pk, finish_reason="stop", token_ids=[5, 6, 7])
    audit = Audit.objects.get(job_id=plain.pk)
    assert audit.by_hosts and audit.scorer_id is None
    continued = claim_door(bridge)
    assert continued["id"] == again.pk and continued["rewrite"] == "{"
    assert claim_door(bridge) is None and Audit.objects.get(pk=audit.pk).scorer_id is None
    RingPlan.objects.filter(bridge_host=bridge.host).update(
        status=RingPlan.Status.RETIRED
    )  # a host of the whole model now
    scored = claim_door(bridge)
    assert scored["kind"] == "audit" and scored["id"] == audit.pk
    assert Audit.objects.get(pk=audit.pk).scorer_id == bridge.host.pk
