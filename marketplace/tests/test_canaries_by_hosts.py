"""Verification of a model whose weights only trusted hosts hold (issue 29): a new host gets
canaries of it through the claim path, made of corpus prompts (the gateway never held the
file, so there is no reference) and judged by their audit, which trusted hosts score; and a
scorer that restarts (a new boot id) gives back the audit it held at once."""

from __future__ import annotations

import asyncio

import pytest

from hosts.models import Host
from marketplace import services
from marketplace.hostdoor import claiming
from marketplace.lifecycle import canaries
from marketplace.models import Audit, AuditScore, CanaryCheck, CanaryReference, Request
from marketplace.tests.test_audits_by_hosts import _audited, _claim, _verdict, remote_model, scorers
from marketplace.tests.test_live_canaries import make_host
from marketplace.trust import audits
from testkit.personas import present

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.audits]

__all__ = ["remote_model", "scorers"]  # (fixtures, shared with the tests of audits scored by hosts)

CORPUS_PROMPTS = [
    item["prompt"] if item["kind"] == "completion" else item["messages"][-1] for item in canaries.corpus()
]


def _claimed(serving, *, boot: str = "") -> dict | None:  # noqa: ANN001
    """One claim through the door mahout uses (the canary that is due is queued there first)."""
    return asyncio.run(
        claiming.claim_when_offered(present(serving).host, fingerprint=serving.fingerprint, wait=0.2, boot=boot)
    )


def _canary_answered(settings, *, text: str = "Hello there.") -> tuple[CanaryCheck, Audit]:  # noqa: ANN001
    """A new host claims its first work: a canary, which it answers; its audit is opened."""
    settings.AUDIT_RATE = settings.AUDIT_PROBATION_RATE = 0.0  # a canary is audited whatever the rate
    newcomer = make_host(name="newcomer")
    payload = _claimed(newcomer)
    check = CanaryCheck.objects.select_related("request").get(host=newcomer.host)
    job = check.request.jobs.get()
    assert payload is not None and payload["id"] == job.pk
    services.job_push_tokens(host=newcomer.host, job_id=job.pk, seq=0, text=text)
    services.job_complete(host=newcomer.host, job_id=job.pk, finish_reason="stop", token_ids=[5, 6, 7])
    check.refresh_from_db()
    return check, Audit.objects.get(request_id=check.request_id)


def test_a_new_host_of_a_model_only_hosts_hold_gets_canaries_judged_by_their_audit(
    remote_model, scorers, settings
) -> None:  # noqa: ANN001
    assert not CanaryReference.objects.exists()  # the gateway never held the file
    check, audit = _canary_answered(settings)
    request = check.request
    assert check.by_audit and check.reference is None and check.verdict == CanaryCheck.Verdict.SCORING
    asked = audit.payload["prompt"] if request.kind == Request.Kind.COMPLETION else audit.payload["messages"][-1]
    assert asked in CORPUS_PROMPTS  # a corpus prompt (under a system turn, as often as not), never a customer's
    assert (
        request.params["temperature"] == 1.0 and request.params["max_tokens"] == settings.CANARY_MAX_TOKENS
    )  # as customers
    assert audit.by_hosts and audit.host_id == check.host_id
    assert canaries.canary_score_pending() == 0, "decided before its audit"
    assert _claim(scorers[0])["id"] == audit.pk
    assert _verdict(scorers[0], audit.pk, "passed") == Audit.Status.PASSED
    assert canaries.canary_score_pending() == 1
    check.refresh_from_db()
    assert check.verdict == CanaryCheck.Verdict.PASSED


def test_a_junk_canary_fails_once_a_second_scorer_confirms_and_the_host_is_stopped(
    remote_model, scorers, settings
) -> None:  # noqa: ANN001
    check, audit = _canary_answered(settings, text="junk junk junk")
    _claim(scorers[0])
    assert _verdict(scorers[0], audit.pk, "failed", "token 1 is not the seed's draw") == Audit.Status.PENDING
    assert canaries.canary_score_pending() == 0
    _claim(scorers[1])
    assert _verdict(scorers[1], audit.pk, "failed", "token 1 is not the seed's draw") == Audit.Status.FAILED
    assert canaries.canary_score_pending() == 1
    check.refresh_from_db()
    host = Host.objects.get(pk=check.host_id)
    assert check.verdict == CanaryCheck.Verdict.FAILED and "token 1 is not the seed's draw" in check.reason
    assert host.maintenance_by == "verification" and host.trusted_at is None


def test_a_canary_no_scorer_read_is_void_not_passed(remote_model, scorers, settings) -> None:  # noqa: ANN001
    from datetime import timedelta

    from django.utils import timezone

    check, audit = _canary_answered(settings)
    Audit.objects.filter(pk=audit.pk).update(
        created_at=timezone.now() - timedelta(seconds=settings.AUDIT_SCORER_WAIT_SECONDS + 1)
    )
    assert audits.audit_scorers_watch() == 1  # released unchecked: the host is paid, but vouched for by nothing
    assert canaries.canary_score_pending() == 1
    check.refresh_from_db()
    assert check.verdict == CanaryCheck.Verdict.VOID


def test_without_a_trusted_scorer_or_with_audits_off_such_a_model_gets_no_canary(remote_model, settings) -> None:  # noqa: ANN001
    newcomer = make_host(name="newcomer")
    assert canaries.canary_send(host=newcomer.host) is None  # nobody could judge it
    make_host(name="scorer", trusted=True)
    settings.AUDIT_ENABLED = False
    assert canaries.canary_send(host=newcomer.host) is None
    settings.AUDIT_ENABLED = True
    assert canaries.canary_send(host=newcomer.host).reference is None


def test_a_model_with_references_the_gateway_cannot_read_gets_canaries_judged_by_hosts(
    remote_model, scorers, settings
) -> None:  # noqa: ANN001
    """References computed while the operator held the file: once it is gone, a near-tie
    could not be scored on the gateway; trusted hosts judge the canary's audit instead."""
    CanaryReference.objects.create(
        model=remote_model,
        kind="chat",
        prompt=[{"role": "user", "content": "Name three colours."}],
        max_tokens=24,
        text=" Red, green and blue.",
        tokens=6,
        exact_chars=21,
    )
    check = canaries.canary_send(host=make_host(name="newcomer").host)
    assert check.by_audit and check.reference is not None and check.request.params["temperature"] == 1.0


# --- a restarted scorer ----------------------------------------------------------------------


def test_a_restarted_scorer_gives_back_its_audit_at_once(customer, serving_host, scorers, settings) -> None:  # noqa: ANN001
    settings.CANARY_ENABLED = False  # (a trusted scorer's own canary of the model would come first)
    audit = _audited(customer, serving_host, settings)
    payload = _claimed(scorers[0], boot="first-process")  # through the claim door: the boot id is kept
    assert payload["kind"] == "audit" and payload["id"] == audit.pk
    scorer = scorers[0].host.pk
    assert services.host_boot_seen(host_id=scorer, boot="first-process") == 0, "the same process"
    assert services.host_boot_seen(host_id=scorer, boot="") == 0, "an older client says nothing"
    assert Audit.objects.get(pk=audit.pk).scorer_id == scorer
    assert services.host_boot_seen(host_id=scorer, boot="its-next-start") == 1
    audit.refresh_from_db()
    assert audit.scorer_id is None and audit.scorer_boot == "" and audit.status == Audit.Status.PENDING
    assert AuditScore.objects.get(audit=audit, scorer_id=scorer).verdict == AuditScore.Verdict.ABANDONED
    assert _claimed(scorers[0], boot="its-next-start") is None, "not back to the process that lost it"
    assert _claimed(scorers[1], boot="another")["id"] == audit.pk
    assert _verdict(scorers[1], audit.pk, "passed") == Audit.Status.PASSED


def test_an_audit_claimed_without_a_boot_id_waits_out_the_timeout(customer, serving_host, scorers, settings) -> None:  # noqa: ANN001
    audit = _audited(customer, serving_host, settings)
    assert _claim(scorers[0])["id"] == audit.pk  # (an older client: no boot id)
    assert services.host_boot_seen(host_id=scorers[0].host.pk, boot="a-new-client") == 0
    assert Audit.objects.get(pk=audit.pk).scorer_id == scorers[0].host.pk


def test_the_heartbeat_door_frees_it_too(customer, serving_host, scorers, settings, client) -> None:  # noqa: ANN001
    settings.CANARY_ENABLED = False
    audit = _audited(customer, serving_host, settings)
    assert _claimed(scorers[0], boot="first-process")["id"] == audit.pk
    answer = client.post(
        "/hosts/api/heartbeat",
        {"fingerprint": scorers[0].fingerprint, "boot": "its-next-start"},
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {scorers[0].token}",
    )
    assert answer.status_code == 200, answer.content
    assert Audit.objects.get(pk=audit.pk).scorer_id is None
    assert Request.objects.get(pk=audit.request_id).status == Request.Status.COMPLETED
