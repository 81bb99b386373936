"""A job that needs a single machine (a `response_format`'s grammar) never goes to a host that
serves its model through a ring it bridges: the ring's stages hold no grammar, and each refusal
would count as the bridge's failure until it rested in maintenance (log-probabilities and
top_p < 1 a ring serves). Such a job is offered to, and claimed by, a host holding the
whole model; the bridge keeps every other job of the model, and the jobs of models it serves on
its own machine. A bridge is never handed an audit of its ring's model to score either."""
from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from conftest import make_customer, make_host
from hosts.models import Host
from marketplace import services as market
from marketplace.models import Job
from marketplace.tests.test_routing import beat
from mesh.rings.models import ModelLayout
from mesh.rings.selectors import ring_only_model_ids
from mesh.rings.services import StageSpec, ring_plan_create
from testkit.requests import submit_request

pytestmark = pytest.mark.django_db(transaction=True)  # (the claim door reads the database from another thread)

GRAMMAR = {"response_format": {"type": "json_object"}}
LOGPROBS = {"logprobs": 0}


@pytest.fixture
def bridge(catalog):  # noqa: ANN001, ANN201
    """A warm host that serves the model through a two-stage ring it bridges (its own stages)."""
    serving = make_host(name="bridge")
    n_layers = ModelLayout.objects.get_or_create(model=catalog, defaults={"n_layers": 18})[0].n_layers  # (flushed by an earlier test)
    ring_plan_create(model_name=catalog.name, row_width=64, micro_batch=2, bridge_host=serving.host,
                     stages=[StageSpec(0, n_layers // 2, None), StageSpec(n_layers // 2, n_layers, None)])
    beat(serving, loaded=[catalog.name], slots=4)
    return serving


def lapse(job: Job) -> None:
    """Every offer and grace over: any host routing lets take it may claim it now."""
    past = timezone.now() - timedelta(seconds=1)
    Job.objects.filter(pk=job.pk).update(offer_until=past, warm_until=past)


def test_a_job_that_needs_a_single_machine_skips_the_bridge_and_goes_to_a_whole_model_host(catalog, bridge) -> None:  # noqa: ANN001
    request = submit_request(make_customer(), catalog, max_tokens=8, prompt_tokens=3, **GRAMMAR)
    job = Job.objects.get(request=request)
    assert job.single_machine and job.offered_host_id is None, "the bridge, the only warm host, is not offered it"
    lapse(job)
    assert market.job_claim_next(host=bridge.host, fingerprint=bridge.fingerprint) is None
    whole = make_host(name="whole", fingerprint="e" * 64)
    beat(whole, loaded=[catalog.name])
    assert market.job_claim_next(host=whole.host, fingerprint=whole.fingerprint).pk == job.pk


def test_the_offer_of_such_a_job_passes_over_a_free_bridge_for_a_whole_model_host(catalog, bridge) -> None:  # noqa: ANN001
    whole = make_host(name="whole", fingerprint="e" * 64)
    beat(whole, loaded=[catalog.name])
    Host.objects.filter(pk=whole.host.pk).update(slots=1)
    for _ in range(3):  # least-connections would offer the bridge (4 slots, idle) these by load alone
        job = Job.objects.get(request=submit_request(make_customer(), catalog, max_tokens=8, prompt_tokens=3, **GRAMMAR))
        assert job.offered_host_id in (whole.host.pk, None)
        Job.objects.filter(pk=job.pk).update(status=Job.Status.FAILED)
    plain = Job.objects.get(request=submit_request(make_customer(), catalog, max_tokens=8, prompt_tokens=3))
    assert not plain.single_machine and plain.offered_host_id is not None


@pytest.mark.parametrize("asked", [{"top_p": 0.9}, LOGPROBS], ids=["top_p", "logprobs"])
def test_the_bridge_keeps_its_models_other_jobs_and_a_lapsed_offer_is_never_moved_to_it(catalog, bridge, asked) -> None:  # noqa: ANN001
    plain = Job.objects.get(request=submit_request(make_customer(), catalog, max_tokens=8, prompt_tokens=3, **asked))
    assert not plain.single_machine, "a ring draws top_p < 1 by the specified sampler and reports log-probabilities"
    lapse(plain)
    assert market.job_claim_next(host=bridge.host, fingerprint=bridge.fingerprint).pk == plain.pk
    whole = make_host(name="whole", fingerprint="e" * 64)
    beat(whole, loaded=[catalog.name])
    structured = Job.objects.get(request=submit_request(make_customer(), catalog, max_tokens=8, prompt_tokens=3, **GRAMMAR))
    Job.objects.filter(pk=structured.pk).update(offered_host_id=None, offer_until=None)
    market.job_reoffer(job_id=structured.pk)
    assert Job.objects.get(pk=structured.pk).offered_host_id == whole.host.pk


def test_a_continuation_of_such_a_job_keeps_the_rule(catalog, bridge) -> None:  # noqa: ANN001
    whole = make_host(name="whole", fingerprint="e" * 64)
    beat(whole, loaded=[catalog.name])
    request = submit_request(make_customer(), catalog, max_tokens=8, prompt_tokens=3, stream=True, **GRAMMAR)
    job = Job.objects.get(request=request)
    lapse(job)
    claimed = market.job_claim_next(host=whole.host, fingerprint=whole.fingerprint)
    market.host_connection_lost(host_id=whole.host.pk)  # it dies before its first token: the job goes back to the queue
    again = Job.objects.filter(request=request).exclude(pk=claimed.pk).get()
    assert again.single_machine
    lapse(again)
    assert market.job_claim_next(host=bridge.host, fingerprint=bridge.fingerprint) is None


def claim_door(serving) -> dict | None:  # noqa: ANN001
    """What the host's claim long-poll answers at once (`POST /hosts/api/claim`, no wait)."""
    answer = Client().post("/hosts/api/claim", data=json.dumps({"fingerprint": serving.fingerprint, "wait": 0}),
                           content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {serving.token}")
    assert answer.status_code in (200, 204), answer.content
    return answer.json()["job"] if answer.status_code == 200 else None  # (204: nothing for it now)


@pytest.mark.audits
def test_through_the_claim_door_the_bridge_gets_neither_such_a_job_nor_an_audit_of_its_ring_model(catalog, bridge, settings) -> None:  # noqa: ANN001
    from catalog.models import CatalogModel
    from marketplace.models import Audit
    from marketplace.reputation import trust_grant
    from mesh.rings.models import RingPlan

    CatalogModel.objects.filter(pk=catalog.pk).update(weights_path="/nowhere/gone.gguf", tokenizer="bytes")  # hosts score
    trust_grant(host_id=bridge.host.pk)
    structured = Job.objects.get(request=submit_request(make_customer(), catalog, max_tokens=8, prompt_tokens=3, **GRAMMAR))
    lapse(structured)
    settings.AUDIT_PROBATION_RATE = 1.0
    other = make_host(name="other", fingerprint="d" * 64)  # in probation: every job of it audited
    beat(other, loaded=[catalog.name])
    plain = Job.objects.get(request=submit_request(make_customer(), catalog, max_tokens=8, prompt_tokens=3, temperature=0.8))
    Job.objects.filter(pk=plain.pk).update(offered_host_id=other.host.pk)
    claimed = market.job_claim_next(host=other.host, fingerprint=other.fingerprint)
    assert claimed.pk == plain.pk
    market.job_push_tokens(host=other.host, job_id=claimed.pk, seq=0, text="Hello there.")
    market.job_complete(host=other.host, job_id=claimed.pk, finish_reason="stop", token_ids=[5, 6, 7])
    audit = Audit.objects.get(job_id=plain.pk)
    assert audit.by_hosts and audit.scorer_id is None
    assert claim_door(bridge) is None
    assert Job.objects.get(pk=structured.pk).status == Job.Status.QUEUED and Audit.objects.get(pk=audit.pk).scorer_id is None
    RingPlan.objects.filter(bridge_host=bridge.host).update(status=RingPlan.Status.RETIRED)  # a host of the whole model now
    assert claim_door(bridge)["id"] == structured.pk
    scored = claim_door(bridge)
    assert scored["kind"] == "audit" and scored["id"] == audit.pk
    assert Audit.objects.get(pk=audit.pk).scorer_id == bridge.host.pk


def chat(customer, body: dict):  # noqa: ANN001, ANN201
    return Client().post("/v1/chat/completions", data=json.dumps({"messages": [{"role": "user", "content": "hi"}], **body}),
                         content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {customer.secret}")


def test_a_model_only_rings_serve_refuses_what_they_cannot_do_at_once_and_says_so(catalog, bridge) -> None:  # noqa: ANN001
    customer = make_customer()
    refused = chat(customer, {"model": catalog.name, "max_tokens": 8, **GRAMMAR})
    assert refused.status_code == 400, refused.content
    error = refused.json()["error"]
    assert error["code"] == "unsupported_parameter" and error["param"] == "response_format"
    assert "only by rings" in error["message"]
    assert not Job.objects.exists(), "nothing queued, nothing held"
    listed = Client().get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {customer.secret}").json()["data"]
    (entry,) = [m for m in listed if m["id"] == catalog.name]
    assert "response_format" not in entry["supported_parameters"]
    assert {"temperature", "top_p", "logprobs", "top_logprobs"} <= set(entry["supported_parameters"])
    whole = make_host(name="whole", fingerprint="e" * 64)  # a host of the whole model joins: it can
    beat(whole, loaded=[catalog.name])
    listed = Client().get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {customer.secret}").json()["data"]
    (entry,) = [m for m in listed if m["id"] == catalog.name]
    assert "response_format" in entry["supported_parameters"]
    assert catalog.pk not in ring_only_model_ids()  # (admission's rule: the request is queued for that host)
