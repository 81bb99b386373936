"""Canaries that look like customers' jobs (issue 29): on a model the gateway can audit, a
canary takes its sampling from recent customer requests (never their words), is audited
whatever the audit rate, and takes its audit's verdict."""

from __future__ import annotations

import pytest

from conftest import make_customer
from hosts.models import Host
from marketplace import services
from marketplace.lifecycle import canaries
from marketplace.models import Audit, CanaryCheck, CanaryReference, Request
from marketplace.trust import audits
from testkit.evidence import drawn
from testkit.personas import make_host as _make_host
from testkit.requests import submit_request

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.audits]

PROMPT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture
def reference(catalog) -> CanaryReference:  # noqa: ANN001
    return CanaryReference.objects.create(
        model=catalog, kind="chat", prompt=PROMPT, max_tokens=24, text=" Red, green and blue.", tokens=6, exact_chars=21
    )


def make_host(**kwargs):  # noqa: ANN003, ANN201
    """A host as its heartbeat leaves it: present, with its machine's fingerprint."""
    serving = _make_host(**kwargs)
    Host.objects.filter(pk=serving.host.pk).update(fingerprint=serving.fingerprint)
    serving.host.refresh_from_db()
    return serving


def _answered(check: CanaryCheck, serving, *, text: str = " Red, green and blue.") -> CanaryCheck:  # noqa: ANN001
    job = services.job_claim_next(host=serving.host, fingerprint=serving.fingerprint)
    assert job is not None and job.request_id == check.request_id
    services.job_push_tokens(host=serving.host, job_id=job.pk, seq=0, text=text)
    services.job_complete(host=serving.host, job_id=job.pk, finish_reason="stop", token_ids=drawn(job.pk))
    check.refresh_from_db()
    return check


def test_a_canary_samples_as_customers_do_and_carries_none_of_their_words(catalog, reference) -> None:  # noqa: ANN001
    customer = make_customer()
    for _ in range(3):
        submit_request(
            customer,
            catalog,
            messages=[{"role": "user", "content": "my secret plan"}],
            temperature=0.7,
            top_p=0.9,
            max_tokens=300,
        )
    host = make_host(name="new")
    check = canaries.canary_send(host=host.host)
    params = check.request.params
    assert check.by_audit
    assert (params["temperature"], params["top_p"], params["max_tokens"]) == (
        0.7,
        0.9,
        128,
    )  # capped: CANARY_MAX_TOKENS
    assert params["seed"] is None  # the gateway's seed, as for any job
    assert check.request.messages[-1] == PROMPT[-1]
    assert all(m["content"] in canaries.SYSTEM_PROMPTS for m in check.request.messages[:-1])
    assert "secret" not in str(check.request.messages)


def test_with_no_customer_traffic_a_canary_samples_as_a_client_that_sets_nothing(catalog, reference) -> None:  # noqa: ANN001
    check = canaries.canary_send(host=make_host(name="new").host)
    assert (check.request.params["temperature"], check.request.params["top_p"]) == (1.0, 1.0)
    assert check.request.params["max_tokens"] == 128


def test_a_model_nobody_can_audit_keeps_greedy_canaries_against_the_reference(catalog, reference, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(canaries, "audit_possible", lambda model, besides: False)  # no weights here, no trusted scorer
    check = canaries.canary_send(host=make_host(name="new").host)
    assert not check.by_audit
    assert (check.request.params["temperature"], check.request.params["max_tokens"]) == (0.0, 24)


@pytest.mark.parametrize("passed", [True, False])
def test_a_canary_is_audited_whatever_the_rate_and_takes_the_audits_verdict(
    catalog, reference, settings, passed
) -> None:  # noqa: ANN001
    settings.AUDIT_RATE = settings.AUDIT_PROBATION_RATE = 0.0
    serving = make_host(name="rig", trusted=True)
    check = _answered(canaries.canary_send(host=serving.host), serving)
    audit = Audit.objects.get(request_id=check.request_id)
    assert check.verdict == CanaryCheck.Verdict.SCORING and audit.status == Audit.Status.PENDING
    assert canaries.canary_score_pending() == 0, "decided before its audit"
    audits.audit_decide(
        audit=audit,
        reason=None if passed else "token 2 is not the seed's draw",
        counts={"checked": 3, "uncertain": 0, "misses": 0 if passed else 1},
    )
    assert canaries.canary_score_pending() == 1
    check.refresh_from_db()
    serving.host.refresh_from_db()
    if passed:
        assert check.verdict == CanaryCheck.Verdict.PASSED and serving.host.maintenance_since is None
    else:
        assert check.verdict == CanaryCheck.Verdict.FAILED and "token 2 is not the seed's draw" in check.reason
        assert serving.host.maintenance_by == "verification"
    assert canaries.canary_score_pending() == 0  # decided once


def test_a_canary_no_audit_can_read_is_void_not_passed(catalog, reference, settings, monkeypatch) -> None:  # noqa: ANN001
    serving = make_host(name="rig")
    check = canaries.canary_send(host=serving.host)
    monkeypatch.setattr(
        audits, "audit_weights", lambda model, assemble=True: None
    )  # the weights left the gateway since
    check = _answered(check, serving)
    assert check.verdict == CanaryCheck.Verdict.VOID and not Audit.objects.filter(request_id=check.request_id).exists()
    assert Request.objects.get(pk=check.request_id).status == Request.Status.COMPLETED
