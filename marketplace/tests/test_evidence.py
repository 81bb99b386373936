"""A completion is evidence (marketplace/lifecycle/evidence.py): a host that completes a job
with nothing, with no token ids, or with ids the model's draw cannot have ended on is refused
before any money moves: nothing billed, nothing paid, the request back in the queue."""

from __future__ import annotations

import pytest

from billing import selectors as ledger
from catalog.models import CatalogModel
from catalog.tokenizer import tokenizer_for
from hosts.models import Host
from marketplace import services
from marketplace.lifecycle.errors import CompletionRefused
from marketplace.models import Audit, Job, Request
from testkit.evidence import drawn
from testkit.requests import submit_request

pytestmark = pytest.mark.django_db(transaction=True)


def _host_balance(host: Host) -> int:
    account = ledger.host_account(host=host)
    return account.balance_ucents if account else 0


def _claimed(customer, catalog, serving_host, **params):  # noqa: ANN001, ANN003
    request = submit_request(customer, catalog, **params)
    job = services.job_claim_next(host=serving_host.host, fingerprint=serving_host.fingerprint)
    assert job is not None and job.request_id == request.pk
    return request, job


def _refused_unpaid(request: Request, job: Job, host: Host) -> None:
    """The attempt ended as its host's failure; the request waits for another host; no money moved."""
    job.refresh_from_db()
    request.refresh_from_db()
    assert job.status == Job.Status.FAILED and job.earned_ucents == 0
    assert request.status != Request.Status.COMPLETED and request.cost_ucents == 0
    assert Job.objects.filter(request=request, status=Job.Status.QUEUED).exists()  # requeued before its first token
    assert _host_balance(host) == 0


def test_an_empty_completion_without_token_ids_is_refused_and_requeued(customer, catalog, serving_host) -> None:
    request, job = _claimed(customer, catalog, serving_host)
    with pytest.raises(CompletionRefused, match="no token ids"):
        services.job_complete(host=serving_host.host, job_id=job.pk, finish_reason="stop")
    _refused_unpaid(request, job, serving_host.host)


def test_text_without_token_ids_is_refused_too(customer, catalog, serving_host) -> None:
    request, job = _claimed(customer, catalog, serving_host)
    services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text="Hello there.")
    with pytest.raises(CompletionRefused, match="no token ids"):
        services.job_complete(host=serving_host.host, job_id=job.pk, finish_reason="stop")
    job.refresh_from_db()
    request.refresh_from_db()
    assert job.status == Job.Status.FAILED and job.earned_ucents == 0
    assert request.cost_ucents == 0 and _host_balance(serving_host.host) == 0


def test_an_empty_answer_that_is_not_the_seeds_first_draw_is_caught_and_its_host_blamed(
    customer, catalog, serving_host
) -> None:
    """The cheat's cheapest answer: nothing, with the end of generation as its only token. The
    gateway holds the shipped model's weights and recomputes that first draw (one prefill)."""
    request, job = _claimed(
        customer, catalog, serving_host, temperature=0.0
    )  # greedy: the draw is the model's top token
    eos = tokenizer_for(catalog.tokenizer).end_of_generation()
    with pytest.raises(CompletionRefused) as refused:
        services.job_complete(host=serving_host.host, job_id=job.pk, finish_reason="stop", token_ids=[eos])
    assert refused.value.proven
    _refused_unpaid(request, job, serving_host.host)
    host = Host.objects.get(pk=serving_host.host.pk)
    assert host.maintenance_reason and "empty answer" in host.maintenance_reason


def test_stop_on_neither_an_end_of_generation_nor_a_stop_string_is_refused(customer, catalog, serving_host) -> None:
    request, job = _claimed(customer, catalog, serving_host)
    services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text="Hello there.")
    with pytest.raises(CompletionRefused, match="neither the model's end of generation nor a stop string"):
        services.job_complete(
            host=serving_host.host, job_id=job.pk, finish_reason="stop", token_ids=drawn(job.pk, ended=False)
        )
    assert Request.objects.get(pk=request.pk).cost_ucents == 0


@pytest.mark.parametrize(
    ("forged", "why"), [("past", "past an end of generation"), ("outside", "not in the model's vocabulary")]
)
def test_ids_past_an_end_of_generation_or_outside_the_vocabulary_are_refused(
    customer, catalog, serving_host, forged, why
) -> None:
    eos = tokenizer_for(catalog.tokenizer).end_of_generation()
    request, job = _claimed(customer, catalog, serving_host)
    services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text="Hi")
    ids = [*drawn(job.pk, ended=False), eos, eos] if forged == "past" else [10**9, eos]
    with pytest.raises(CompletionRefused, match=why) as refused:
        services.job_complete(host=serving_host.host, job_id=job.pk, finish_reason="stop", token_ids=ids)
    assert refused.value.proven
    assert Request.objects.get(pk=request.pk).cost_ucents == 0 and _host_balance(serving_host.host) == 0


def test_an_honest_answer_stopped_by_a_stop_string_is_paid(customer, catalog, serving_host) -> None:
    """mahout leaves a stop string out of the text it sends; its last token completes it."""
    request, job = _claimed(customer, catalog, serving_host, stop=["\n\n"])
    services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text="Hello there.")
    ids = tokenizer_for(catalog.tokenizer).token_ids("Hello there.\n\n")
    done = services.job_complete(host=serving_host.host, job_id=job.pk, finish_reason="stop", token_ids=ids)
    assert done.earned_ucents > 0 and done.request.finish_reason == "stop"


def test_an_honest_answer_ended_by_the_model_is_paid(customer, catalog, serving_host) -> None:
    request, job = _claimed(customer, catalog, serving_host)
    services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text="Hello there.")
    done = services.job_complete(host=serving_host.host, job_id=job.pk, finish_reason="stop", token_ids=drawn(job.pk))
    assert done.earned_ucents > 0
    assert _host_balance(serving_host.host) == done.earned_ucents


def test_an_empty_answer_the_gateway_cannot_recompute_is_audited_with_its_share_in_escrow(
    customer,
    catalog,
    serving_host,
    settings,
) -> None:
    """Without the weights on the gateway, trusted hosts score it: the host's share waits."""
    settings.AUDIT_PROBATION_RATE = 0.0
    CatalogModel.objects.filter(pk=catalog.pk).update(tokenizer="bytes", weights_path="/nowhere/gone.gguf")
    from conftest import make_host

    make_host(name="scorer", trusted=True, fingerprint="s" * 64)  # a trusted host of another owner can score it
    request, job = _claimed(customer, catalog, serving_host)
    services.job_complete(host=serving_host.host, job_id=job.pk, finish_reason="stop", token_ids=[0])
    audit = Audit.objects.get(job=job)
    assert audit.status == Audit.Status.PENDING and audit.by_hosts
    assert _host_balance(serving_host.host) == 0  # nothing payable until a scorer passes it


def test_the_host_api_answers_a_refused_completion_in_the_apis_error_format(
    customer, catalog, serving_host, client
) -> None:
    request, job = _claimed(customer, catalog, serving_host)
    response = client.post(
        f"/hosts/api/jobs/{job.pk}/complete",
        {"finish_reason": "stop"},
        content_type="application/json",
        headers={"Authorization": f"Bearer {serving_host.token}"},
    )
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "completion_refused"
    _refused_unpaid(request, job, serving_host.host)
