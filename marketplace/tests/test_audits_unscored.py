"""No job is paid unchecked, and scorers' declines are counted per model and cause (issue 50,
item 4; marketplace/trust/audits.py): an answer the gateway's verifier cannot read is unscored (the
customer refunded, the host neither paid nor blamed), weights that vanished hand the audit to
independent hosts, a split of host scorers goes to the gateway's own verifier where it holds
the weights, and one model's declines do not stop a scorer's audits of the others."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from billing import selectors as ledger
from catalog.models import CatalogModel
from hosts.models import Host
from marketplace import services
from marketplace.models import Audit, AuditScore, Request
from marketplace.tests.test_audits_by_hosts import _audited, _balance, _claim, _escrow, _verdict, remote_model, scorers
from marketplace.trust import audit_scoring, audits
from testkit.evidence import drawn
from testkit.personas import make_host, present
from testkit.requests import submit_request

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.audits]

__all__ = ["remote_model", "scorers"]  # (fixtures, shared with the tests of audits scored by hosts)


def _served_on_the_gateway(customer, catalog, serving_host, settings) -> Audit:  # noqa: ANN001
    """A probation host's job of the shipped model (the gateway holds its weights), served
    honestly and settled: its audit waits for the gateway's verifier."""
    settings.AUDIT_PROBATION_RATE = 1.0
    submit_request(customer, catalog, temperature=0.8)
    job = services.job_claim_next(host=serving_host.host, fingerprint=serving_host.fingerprint)
    services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text="Hello there.")
    services.job_complete(host=serving_host.host, job_id=job.pk, finish_reason="stop", token_ids=drawn(job.pk))
    audit = Audit.objects.select_related("request").get(job=job)
    assert not audit.by_hosts and audit.status == Audit.Status.PENDING
    return audit


def test_an_answer_the_gateways_verifier_cannot_read_is_unscored_never_paid_unchecked(
    customer, catalog, serving_host, settings, monkeypatch
) -> None:  # noqa: ANN001
    """Before, `Unauditable` (an answer past the verifier's context) released the escrow to the
    host unchecked: a cheat serving long contexts was never read and always paid."""
    from scorer.verify import Unauditable

    before = ledger.customer_account(user=customer.user).balance_ucents
    audit = _served_on_the_gateway(customer, catalog, serving_host, settings)

    def cannot(audit: Audit) -> tuple:
        raise Unauditable("4000 + 200 tokens do not fit in 4096")

    monkeypatch.setattr(audit_scoring, "audit_verdict", cannot)
    assert audit_scoring.audit_score_pending() == 1
    audit.refresh_from_db()
    serving_host.host.refresh_from_db()
    assert audit.status == Audit.Status.UNSCORED and "cannot read it" in audit.reason and audit.payload is None
    assert ledger.customer_account(user=customer.user).balance_ucents == before  # refunded to the µ¢
    assert _escrow() == 0 and _balance(serving_host.host) == 0  # the host's share voided
    assert serving_host.host.maintenance_since is None and serving_host.host.banned_at is None  # not blamed
    assert ledger.reconcile_report() == []


def test_weights_that_vanished_hand_the_audit_to_independent_hosts_or_it_is_unscored(
    customer, catalog, serving_host, settings, monkeypatch
) -> None:  # noqa: ANN001
    def gone(audit: Audit) -> tuple:
        raise LookupError("the weights of gemma-3-270m are no longer on this gateway")

    monkeypatch.setattr(audit_scoring, "audit_verdict", gone)
    alone = _served_on_the_gateway(customer, catalog, serving_host, settings)
    own = make_host(name="own", trusted=True)  # only a host of the audited owner holds the model: it may not score
    Host.objects.filter(pk=own.host.pk).update(owner=serving_host.host.owner)
    assert audit_scoring.audit_score_pending() == 1
    assert Audit.objects.get(pk=alone.pk).status == Audit.Status.UNSCORED and _balance(serving_host.host) == 0
    scorer = make_host(name="scorer", trusted=True)
    handed = _served_on_the_gateway(customer, catalog, serving_host, settings)
    assert audit_scoring.audit_score_pending() == 0
    handed.refresh_from_db()
    assert handed.by_hosts and handed.status == Audit.Status.PENDING
    assert _claim(own) is None and _claim(scorer)["id"] == handed.pk
    assert _verdict(scorer, handed.pk, "passed") == Audit.Status.PASSED
    assert _balance(serving_host.host) == handed.host_ucents
    assert ledger.reconcile_report() == []


def test_a_split_goes_to_the_gateways_verifier_where_it_holds_the_weights(
    customer, serving_host, scorers, settings, monkeypatch, tmp_path
) -> None:  # noqa: ANN001
    audit = _audited(customer, serving_host, settings)
    _claim(scorers[0])
    _verdict(scorers[0], audit.pk, "failed", "made up")
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"GGUF")
    CatalogModel.objects.filter(pk=audit.request.model_id).update(weights_path=str(weights))  # the file is back
    _claim(scorers[1])
    present(scorers[2])
    assert _verdict(scorers[1], audit.pk, "passed") == "pending"
    audit.refresh_from_db()
    assert not audit.by_hosts and audit.chosen_id is None  # the gateway reads it, no host breaks it
    assert _claim(scorers[2]) is None
    monkeypatch.setattr(
        audit_scoring, "audit_verdict", lambda audit: (None, {"checked": 3, "uncertain": 0, "misses": 0})
    )
    assert audit_scoring.audit_score_pending() == 1
    audit.refresh_from_db()
    assert audit.status == Audit.Status.PASSED and _balance(serving_host.host) == audit.host_ucents
    failed, passed = (
        AuditScore.objects.get(audit=audit, scorer=scorers[0].host),
        AuditScore.objects.get(audit=audit, scorer=scorers[1].host),
    )
    assert failed.overruled and failed.paid_ucents == 0  # the minority of the gateway and a scorer: a strike
    assert not passed.overruled and passed.paid_ucents > 0
    assert ledger.reconcile_report() == []


def test_the_gateway_against_a_lone_verdict_strikes_nobody(
    customer, serving_host, scorers, settings, monkeypatch
) -> None:  # noqa: ANN001
    audit = _audited(customer, serving_host, settings)
    _claim(scorers[0])
    _verdict(scorers[0], audit.pk, "failed", "made up")
    Audit.objects.filter(pk=audit.pk).update(by_hosts=False)  # (as the wait's end hands it over)
    monkeypatch.setattr(
        audit_scoring, "audit_verdict", lambda audit: (None, {"checked": 3, "uncertain": 0, "misses": 0})
    )
    assert audit_scoring.audit_score_pending() == 1
    assert Audit.objects.get(pk=audit.pk).status == Audit.Status.PASSED
    assert not AuditScore.objects.filter(audit=audit, overruled=True).exists()  # a 1-1


def test_declines_are_counted_per_model_and_per_cause(customer, serving_host, scorers, settings) -> None:  # noqa: ANN001
    """Before, five declines of any model in a day (answers past the context, say) stopped a
    scorer's audits of every model."""
    settings.AUDIT_SCORER_MAX_DECLINED = 2
    scorer = scorers[0]
    unauditable = "not auditable here: 4000 + 200 tokens do not fit in 4096"
    first = _audited(customer, serving_host, settings)
    assert _claim(scorer)["id"] == first.pk
    _verdict(scorer, first.pk, "declined", unauditable)
    second = _audited(customer, serving_host, settings)
    assert _claim(scorer)["id"] == second.pk
    Audit.objects.filter(pk=second.pk).update(
        scorer_since=timezone.now() - timedelta(seconds=settings.AUDIT_SCORE_TIMEOUT_SECONDS + 1)
    )
    audits.audit_scorers_watch()  # silent: a cause of its own
    assert audits.scorer_declines_capped(host_id=scorer.host.pk, now=timezone.now()) == set()  # one of each cause
    third = _audited(customer, serving_host, settings)
    assert _claim(scorer)["id"] == third.pk
    _verdict(scorer, third.pk, "declined", unauditable)  # two of one cause
    fourth = _audited(customer, serving_host, settings)
    assert _claim(scorer) is None  # that model's audits: no more today
    other = CatalogModel.objects.create(
        name="other-model", context_length=4096, input_price_ucents=10, output_price_ucents=40, tokenizer="bytes"
    )
    Request.objects.filter(pk__in=[first.request_id, third.request_id]).update(
        model=other
    )  # the declines were another model's
    assert audits.scorer_declines_capped(host_id=scorer.host.pk, now=timezone.now()) == {other.pk}
    assert _claim(scorer)["id"] == fourth.pk  # this model's audits are handed to it again
