"""Audits of a model whose weights the gateway lacks, scored by trusted hosts paid to score
(marketplace/trust/audits.py, "scoring by trusted hosts"): who may claim one, how verdicts decide
it (a failure needs a second scorer's confirmation), the fees, strikes, requeues and the
release after AUDIT_SCORER_WAIT_SECONDS."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from billing import selectors as ledger
from billing.models import Account, LedgerTransaction
from catalog.models import CatalogModel
from hosts.models import Host
from marketplace import services
from marketplace.models import Audit, AuditScore
from marketplace.trust import audit_scoring, audits
from protocol.jobs import AUDIT
from testkit.personas import make_host, present
from testkit.requests import submit_request

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.audits]

TOKENS = [5, 6, 7]


@pytest.fixture
def remote_model(catalog: CatalogModel) -> CatalogModel:
    """The catalog's model as if added from a file no longer on the gateway: only hosts hold it."""
    CatalogModel.objects.filter(pk=catalog.pk).update(tokenizer="bytes", weights_path="/nowhere/gone.gguf")
    catalog.refresh_from_db()
    return catalog


@pytest.fixture
def scorers(remote_model: CatalogModel) -> list:
    """Trusted hosts of the model, silent until they claim (routing offers customers' jobs to
    present trusted hosts first, and these jobs are for the host in probation)."""
    return [make_host(name=f"scorer-{n}", trusted=True) for n in range(3)]


def _audited(customer, serving_host, settings):  # noqa: ANN001, ANN202
    """One job of a host in probation, served and settled: its audit, waiting for a scorer."""
    settings.AUDIT_PROBATION_RATE = 1.0
    Host.objects.exclude(pk=serving_host.host.pk).update(last_heartbeat_at=None)  # the job goes to the one in probation
    submit_request(customer, serving_host_model(), temperature=0.8)
    job = services.job_claim_next(host=serving_host.host, fingerprint=serving_host.fingerprint)
    services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text="Hello there.")
    services.job_complete(host=serving_host.host, job_id=job.pk, finish_reason="stop", token_ids=TOKENS)
    return Audit.objects.select_related("request").get(job=job)


def serving_host_model() -> CatalogModel:
    return CatalogModel.objects.get(name="gemma-3-270m")


def _claim(scorer):  # noqa: ANN001, ANN202
    present(scorer)
    return audits.audit_claim_payload(host=scorer.host, model_ids=[serving_host_model().pk])


def _verdict(scorer, audit_id: int, verdict: str, reason: str = "") -> str:  # noqa: ANN001
    return audits.audit_verdict_report(
        host=scorer.host,
        audit_id=audit_id,
        verdict=verdict,
        reason=reason,
        counts={"checked": 3, "uncertain": 0, "misses": 2 if verdict == "failed" else 0},
    )


def _balance(host: Host) -> int:
    account = ledger.host_account(host=host)
    return account.balance_ucents if account else 0


def _escrow() -> int:
    account = Account.objects.filter(kind=Account.Kind.AUDIT_ESCROW).first()
    return account.balance_ucents if account else 0


def test_an_audit_the_gateway_cannot_read_is_claimed_by_a_trusted_host_never_the_audited_one(
    customer, serving_host, scorers, settings
) -> None:
    audit = _audited(customer, serving_host, settings)
    assert audit.by_hosts and audit.status == Audit.Status.PENDING
    assert audit_scoring.audit_score_pending() == 0  # the gateway's workers leave it to the hosts
    assert (
        audits.audit_claim_payload(host=serving_host.host, model_ids=[audit.request.model_id]) is None
    )  # in probation
    Host.objects.filter(pk=serving_host.host.pk).update(trusted_at=timezone.now())  # even trusted: never its own answer
    assert _claim(serving_host) is None
    payload = _claim(scorers[0])
    assert payload["kind"] == AUDIT and payload["id"] == audit.pk and payload["model"] == "gemma-3-270m"
    assert payload["tokens"] == TOKENS and payload["text"] == "Hello there." and payload["seed"] == audit.seed
    assert payload["job"]["messages"] == [{"role": "user", "content": "hi"}] and "id" not in payload["job"]
    assert set(payload) == {
        "id",
        "model",
        "kind",
        "job",
        "tokens",
        "text",
        "finish_reason",
        "seed",
        "logprobs",
        "draw",
    }  # nothing names its host
    assert payload["logprobs"] is None  # the job asked for none
    assert payload["draw"] == settings.AUDIT_TOKENS > 0  # the first scorer checks tokens drawn at random
    assert _claim(scorers[1]) is None  # one scorer at a time


def test_one_trusted_pass_releases_the_escrow_and_pays_the_scorer_from_the_platforms_share(
    customer, serving_host, scorers, settings
) -> None:
    audit = _audited(customer, serving_host, settings)
    assert _claim(scorers[0])["id"] == audit.pk
    assert _verdict(scorers[0], audit.pk, "passed") == Audit.Status.PASSED
    audit.refresh_from_db()
    assert audit.checked == 3 and audit.payload is None and audit.text == "" and audit.token_ids is None
    assert _escrow() == 0 and _balance(serving_host.host) == audit.host_ucents
    fee = audits.scorer_fee(audit.request)
    assert 0 < fee and _balance(scorers[0].host) == min(fee, audit.platform_ucents // 2) > 0
    assert AuditScore.objects.get(audit=audit).paid_ucents == _balance(scorers[0].host)
    assert LedgerTransaction.objects.filter(kind=LedgerTransaction.Kind.AUDIT_SCORE).count() == 1
    assert ledger.reconcile_report() == []


def test_a_failure_is_believed_only_once_a_second_scorer_confirms_it(customer, serving_host, scorers, settings) -> None:
    before = ledger.customer_account(user=customer.user).balance_ucents
    audit = _audited(customer, serving_host, settings)
    _claim(scorers[0])
    assert _verdict(scorers[0], audit.pk, "failed", "2 of 3 tokens are not what the seeded draw selects") == "pending"
    serving_host.host.refresh_from_db()
    assert serving_host.host.maintenance_since is None and _escrow() == audit.host_ucents  # one word is not enough
    assert _claim(scorers[0]) is None  # never the same scorer twice
    confirming = _claim(scorers[1])
    assert confirming["id"] == audit.pk
    assert confirming["draw"] is None  # every token: a miss the first found cannot escape another draw
    assert _verdict(scorers[1], audit.pk, "failed", "2 of 3 tokens miss") == Audit.Status.FAILED
    audit.refresh_from_db()
    serving_host.host.refresh_from_db()
    assert audit.misses == 2 and "seeded draw" in audit.reason and audit.payload is None
    assert (
        serving_host.host.maintenance_since is not None
        and "Failed verification" in serving_host.host.maintenance_reason
    )
    assert ledger.customer_account(user=customer.user).balance_ucents == before  # refunded to the µ¢
    assert _escrow() == 0 and _balance(serving_host.host) == 0
    paid = [s.paid_ucents for s in AuditScore.objects.filter(audit=audit).order_by("pk")]
    assert paid == [_balance(scorers[0].host), _balance(scorers[1].host)]  # both paid what the platform could
    assert ledger.reconcile_report() == []


def test_a_failure_two_others_pass_is_a_strike_and_two_cost_the_scorers_trust(
    customer, serving_host, scorers, settings
) -> None:
    settings.AUDIT_SCORER_MAX_OVERRULED = 2
    for strike in (1, 2):
        audit = _audited(customer, serving_host, settings)
        _claim(scorers[0])
        _verdict(scorers[0], audit.pk, "failed", "made up")
        _claim(scorers[1])
        present(scorers[2])
        assert _verdict(scorers[1], audit.pk, "passed") == "pending"  # 1-1: nobody's majority
        assert not AuditScore.objects.filter(audit=audit, overruled=True).exists()  # a split alone strikes nobody
        assert _claim(scorers[2])["id"] == audit.pk  # the third the gateway chose
        assert _verdict(scorers[2], audit.pk, "passed") == Audit.Status.PASSED  # 2-1
        assert AuditScore.objects.get(audit=audit, scorer=scorers[0].host).overruled
        assert (
            AuditScore.objects.get(audit=audit, scorer=scorers[0].host).paid_ucents == 0
        )  # a verdict that fell: unpaid
        assert [s.scorer_id for s in AuditScore.objects.filter(audit=audit, paid_ucents__gt=0)] == [
            scorers[1].host.pk,
            scorers[2].host.pk,
        ]  # the majority's verdicts stand: both paid
        scorers[0].host.refresh_from_db()
        assert (scorers[0].host.trusted_at is None) == (strike == 2)
    serving_host.host.refresh_from_db()
    assert serving_host.host.maintenance_since is None and _balance(serving_host.host) > 0
    assert _claim(scorers[0]) is None  # back in probation: it scores no more
    assert ledger.reconcile_report() == []


def test_two_colluding_accounts_cannot_overrule_an_honest_scorers_failure(
    customer, serving_host, scorers, settings
) -> None:
    """The cheat's host (account A) answers junk; an honest scorer fails it. A second account
    (B) the cheat opened, with two trusted hosts of the model, passes it. Before: one pass beat
    one failure, the honest scorer got the strike (two a day cost its trust), the cheat was
    paid; and after half of AUDIT_SCORER_WAIT_SECONDS account A's own trusted host could score
    it. Now the split goes to a third owner the gateway chooses, and the colluder is struck."""
    before = ledger.customer_account(user=customer.user).balance_ucents
    settings.AUDIT_SCORER_MAX_OVERRULED = 1
    honest, colluder, third = scorers
    sybil_twin = make_host(name="sybil-twin", trusted=True)  # account B's second host
    Host.objects.filter(pk=sybil_twin.host.pk).update(owner=colluder.host.owner)
    own_trusted = make_host(name="cheats-own", trusted=True)  # account A's own trusted host
    Host.objects.filter(pk=own_trusted.host.pk).update(owner=serving_host.host.owner)
    audit = _audited(customer, serving_host, settings)
    Audit.objects.filter(pk=audit.pk).update(
        created_at=timezone.now() - timedelta(seconds=settings.AUDIT_SCORER_WAIT_SECONDS / 2 + 1)
    )
    assert _claim(own_trusted) is None  # never the audited owner's hosts, however long it waited
    assert _claim(honest)["id"] == audit.pk
    assert _verdict(honest, audit.pk, "failed", "2 of 3 tokens miss") == "pending"
    assert _claim(colluder)["id"] == audit.pk
    for host in (sybil_twin, own_trusted, third):
        present(host)
    assert _verdict(colluder, audit.pk, "passed") == "pending"  # a split: the pass does not decide
    assert not AuditScore.objects.filter(audit=audit, overruled=True).exists()
    assert Audit.objects.get(pk=audit.pk).chosen_id == third.host.pk  # the only further owner
    assert _claim(sybil_twin) is None and _claim(own_trusted) is None  # account B voted already; A never votes
    assert _claim(third)["draw"] is None  # a failure to check: every token
    assert _verdict(third, audit.pk, "failed", "2 of 3 tokens miss") == Audit.Status.FAILED
    serving_host.host.refresh_from_db()
    honest.host.refresh_from_db()
    colluder.host.refresh_from_db()
    assert serving_host.host.maintenance_since is not None and _balance(serving_host.host) == 0  # the cheat is caught
    assert ledger.customer_account(user=customer.user).balance_ucents == before  # its customer refunded
    assert honest.host.trusted_at is not None and not AuditScore.objects.get(audit=audit, scorer=honest.host).overruled
    assert colluder.host.trusted_at is None and AuditScore.objects.get(audit=audit, scorer=colluder.host).overruled
    assert ledger.reconcile_report() == []


def test_only_the_scorer_the_gateway_chose_breaks_a_split_and_another_is_chosen_if_it_is_silent(
    customer, serving_host, scorers, settings
) -> None:
    extra = make_host(name="scorer-3", trusted=True)
    audit = _audited(customer, serving_host, settings)
    _claim(scorers[0])
    _verdict(scorers[0], audit.pk, "passed")  # (drawn for no second look: conftest) ...
    assert Audit.objects.get(pk=audit.pk).status == Audit.Status.PASSED
    audit = _audited(customer, serving_host, settings)
    _claim(scorers[0])
    _verdict(scorers[0], audit.pk, "failed", "2 of 3 tokens miss")
    _claim(scorers[1])
    assert _verdict(scorers[1], audit.pk, "passed") == "pending"  # nobody present to choose: nobody may claim it
    assert Audit.objects.get(pk=audit.pk).chosen_id is None
    assert _claim(scorers[2]) is None and _claim(extra) is None
    audits.audit_scorers_watch()  # both present now: the gateway chooses one
    chosen = Audit.objects.get(pk=audit.pk).chosen_id
    assert chosen in (scorers[2].host.pk, extra.host.pk)
    first, other = (scorers[2], extra) if chosen == scorers[2].host.pk else (extra, scorers[2])
    assert _claim(other) is None  # not the one chosen: no race to be the third
    Audit.objects.filter(pk=audit.pk).update(
        chosen_at=timezone.now() - timedelta(seconds=settings.AUDIT_SCORE_TIMEOUT_SECONDS + 1)
    )
    Host.objects.filter(pk=first.host.pk).update(last_heartbeat_at=None)  # it went away without claiming
    audits.audit_scorers_watch()
    assert Audit.objects.get(pk=audit.pk).chosen_id == other.host.pk
    assert _claim(other)["id"] == audit.pk
    assert _verdict(other, audit.pk, "failed", "2 of 3 tokens miss") == Audit.Status.FAILED
    assert AuditScore.objects.get(audit=audit, scorer=scorers[1].host).overruled


def test_a_decline_or_a_silent_scorer_hands_the_audit_to_another(customer, serving_host, scorers, settings) -> None:
    audit = _audited(customer, serving_host, settings)
    _claim(scorers[0])
    assert _verdict(scorers[0], audit.pk, "declined", "not auditable here") == "pending"
    assert _claim(scorers[1])["id"] == audit.pk
    Audit.objects.filter(pk=audit.pk).update(
        scorer_since=timezone.now() - timedelta(seconds=settings.AUDIT_SCORE_TIMEOUT_SECONDS + 1)
    )
    assert audits.audit_scorers_watch() == 0
    assert AuditScore.objects.get(audit=audit, scorer=scorers[1].host).verdict == AuditScore.Verdict.ABANDONED
    with pytest.raises(Exception, match="not this host's to score"):  # a verdict after it was taken back
        _verdict(scorers[1], audit.pk, "passed")
    assert _claim(scorers[2])["id"] == audit.pk
    assert _verdict(scorers[2], audit.pk, "passed") == Audit.Status.PASSED


def test_a_scorer_that_declines_too_often_is_handed_no_more_audits_that_day(
    customer, serving_host, scorers, settings
) -> None:
    """Declining is unpaid, but free: without a cap a colluder would decline every answer but its
    partner's and pass only those."""
    settings.AUDIT_SCORER_MAX_DECLINED = 2
    for _ in range(2):
        audit = _audited(customer, serving_host, settings)
        assert _claim(scorers[0])["id"] == audit.pk
        assert _verdict(scorers[0], audit.pk, "declined", "not auditable here") == "pending"
        assert _claim(scorers[1])["id"] == audit.pk
        assert _verdict(scorers[1], audit.pk, "passed") == Audit.Status.PASSED
    audit = _audited(customer, serving_host, settings)
    assert _claim(scorers[0]) is None  # two declines today: no more for it
    assert _claim(scorers[1])["id"] == audit.pk  # the audit goes to another scorer
    assert _verdict(scorers[1], audit.pk, "passed") == Audit.Status.PASSED
    AuditScore.objects.filter(scorer=scorers[0].host).update(created_at=timezone.now() - timedelta(days=1, seconds=1))
    second = _audited(customer, serving_host, settings)
    assert _claim(scorers[0])["id"] == second.pk  # a day later it scores again
    for silent in (second, _audited(customer, serving_host, settings)):  # silence instead of a decline counts alike
        if silent is not second:
            assert _claim(scorers[0])["id"] == silent.pk
        Audit.objects.filter(pk=silent.pk).update(
            scorer_since=timezone.now() - timedelta(seconds=settings.AUDIT_SCORE_TIMEOUT_SECONDS + 1)
        )
        audits.audit_scorers_watch()
    _audited(customer, serving_host, settings)
    assert _claim(scorers[0]) is None


@pytest.mark.parametrize("verdicts", [[], ["failed"], ["failed", "passed"]], ids=["none", "a lone failure", "a split"])
def test_an_audit_no_scorer_decides_in_time_is_unscored_never_paid_unchecked(
    customer, serving_host, scorers, settings, verdicts
) -> None:
    """Before, it was released unchecked: the host paid for an answer nobody independent read
    (a cheat's own scorer stalling, or no scorer at all). Now the customer gets back what the
    job cost, the host's share is voided with it, and nobody is blamed or paid."""
    before = ledger.customer_account(user=customer.user).balance_ucents
    audit = _audited(customer, serving_host, settings)
    for scorer, verdict in zip(scorers, verdicts, strict=False):
        _claim(scorer)
        _verdict(scorer, audit.pk, verdict, "2 of 3 tokens miss")
    assert audits.audit_scorers_watch() == 0  # not yet
    Audit.objects.filter(pk=audit.pk).update(
        created_at=timezone.now() - timedelta(seconds=settings.AUDIT_SCORER_WAIT_SECONDS + 1)
    )
    assert audits.audit_scorers_watch() == 1
    audit.refresh_from_db()
    serving_host.host.refresh_from_db()
    assert (
        audit.status == Audit.Status.UNSCORED and audit.payload is None and audit.text == "" and audit.token_ids is None
    )
    assert ledger.customer_account(user=customer.user).balance_ucents == before  # refunded to the µ¢
    assert _escrow() == 0 and _balance(serving_host.host) == 0
    assert serving_host.host.maintenance_since is None  # and not blamed
    assert not AuditScore.objects.filter(audit=audit, overruled=True).exists()
    assert not AuditScore.objects.filter(audit=audit, paid_ucents__gt=0).exists()
    assert ledger.reconcile_report() == []


def test_a_scorer_of_the_audited_hosts_own_owner_never_scores_it(customer, serving_host, scorers, settings) -> None:
    audit = _audited(customer, serving_host, settings)
    Host.objects.filter(pk__in=[s.host.pk for s in scorers]).update(owner=serving_host.host.owner)
    assert _claim(scorers[0]) is None
    Audit.objects.filter(pk=audit.pk).update(
        created_at=timezone.now() - timedelta(seconds=settings.AUDIT_SCORER_WAIT_SECONDS / 2 + 1)
    )
    assert _claim(scorers[0]) is None  # (before: after half of AUDIT_SCORER_WAIT_SECONDS it could)
    assert not audits.scorers_exist(
        model_id=audit.request.model_id, besides=serving_host.host
    )  # its jobs are not held for one


def test_a_new_account_does_not_score_until_it_has_a_history(customer, serving_host, scorers, settings) -> None:
    """A confirmed e-mail is free: its hosts score nothing until the account is
    AUDIT_SCORER_OWNER_MIN_AGE_DAYS old and its own hosts' jobs passed
    AUDIT_SCORER_OWNER_MIN_PASSED_AUDITS audits that were read."""
    scorer = scorers[0]
    settings.AUDIT_RATE = 1.0
    own = [_audited(customer, scorer, settings) for _ in range(3)]  # its own host's jobs, audited
    audits.audit_decide(audit=own[0], reason=None, counts={})  # a pass that read nothing vouches for nothing
    audits.audit_decide(audit=own[1], reason=None, counts={"checked": 3})
    audit = _audited(customer, serving_host, settings)
    settings.AUDIT_SCORER_OWNER_MIN_AGE_DAYS = 14
    settings.AUDIT_SCORER_OWNER_MIN_PASSED_AUDITS = 2
    assert _claim(scorer) is None  # a new account
    assert not audits.scorers_exist(model_id=audit.request.model_id, besides=serving_host.host)  # nobody could score
    get_user_model().objects.filter(pk=scorer.host.owner_id).update(date_joined=timezone.now() - timedelta(days=15))
    assert _claim(scorer) is None  # old enough, but one audit of its hosts passed that was read
    audits.audit_decide(audit=own[2], reason=None, counts={"checked": 3})
    assert audits.scorers_exist(model_id=audit.request.model_id, besides=serving_host.host)
    assert _claim(scorer)["id"] == audit.pk


def test_without_any_trusted_scorer_the_model_is_unverifiable_and_its_jobs_are_not_held(
    customer, serving_host, remote_model, settings
) -> None:
    audit_count = Audit.objects.count()
    settings.AUDIT_PROBATION_RATE = 1.0
    submit_request(customer, remote_model)
    job = services.job_claim_next(host=serving_host.host, fingerprint=serving_host.fingerprint)
    services.job_push_tokens(host=serving_host.host, job_id=job.pk, seq=0, text="Hi.")
    services.job_complete(host=serving_host.host, job_id=job.pk, finish_reason="stop", token_ids=TOKENS)
    assert Audit.objects.count() == audit_count and _balance(serving_host.host) > 0
    summary = audits.audit_summary()
    assert "gemma-3-270m" in summary["unverifiable_models"] and summary["verified_by_hosts_models"] == []
    make_host(name="scorer", trusted=True)
    summary = audits.audit_summary()
    assert (
        summary["verified_by_hosts_models"] == ["gemma-3-270m"] and "gemma-3-270m" not in summary["unverifiable_models"]
    )
    staff = get_user_model().objects.create_user(username="ops@example.com", password="x" * 12, is_staff=True)
    http = Client()
    http.force_login(staff)
    page = http.get("/pool/").content.decode()
    assert "scored by trusted hosts (no weights on the gateway): gemma-3-270m" in page and "not verifiable" not in page


def test_the_verdict_door_checks_who_is_asking_and_what_it_says(customer, serving_host, scorers, settings) -> None:
    audit = _audited(customer, serving_host, settings)
    _claim(scorers[0])
    http = Client()

    def post(scorer, body: dict):  # noqa: ANN001, ANN202
        return http.post(
            f"/hosts/api/audits/{audit.pk}/verdict",
            body,
            content_type="application/json",
            headers={"Authorization": f"Bearer {scorer.token}"},
        )

    assert post(scorers[0], {"verdict": "maybe"}).status_code == 400
    assert post(scorers[0], {"verdict": "passed", "checked": -1}).status_code == 400
    refused = post(scorers[1], {"verdict": "passed"})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "audit_not_yours"
    answer = post(scorers[0], {"verdict": "passed", "checked": 3})
    assert answer.status_code == 200 and answer.json() == {"status": "passed"}
    assert post(scorers[0], {"verdict": "passed"}).status_code == 409  # decided once


def test_a_pass_drawn_for_a_recheck_waits_for_another_owners_look_and_a_second_pass_decides(
    customer, serving_host, scorers, settings
) -> None:
    settings.AUDIT_PASS_RECHECK_RATE = 1.0
    audit = _audited(customer, serving_host, settings)
    Host.objects.filter(pk=scorers[1].host.pk).update(owner=scorers[0].host.owner)  # the first scorer's own owner
    _claim(scorers[0])
    assert _verdict(scorers[0], audit.pk, "passed") == "pending"  # one word, drawn for a second look
    assert _escrow() == audit.host_ucents and _balance(scorers[0].host) == 0
    assert _claim(scorers[1]) is None  # not a host of the same owner: it could vouch for its own
    second = _claim(scorers[2])
    assert second["id"] == audit.pk and second["draw"] == settings.AUDIT_TOKENS  # a draw of its own
    assert _verdict(scorers[2], audit.pk, "passed") == Audit.Status.PASSED
    assert _escrow() == 0 and _balance(serving_host.host) == audit.host_ucents
    assert _balance(scorers[0].host) > 0 and _balance(scorers[2].host) > 0  # both verdicts stand, both paid
    assert not AuditScore.objects.filter(audit=audit, overruled=True).exists()
    assert ledger.reconcile_report() == []


def test_a_scorer_passing_a_cheat_is_overruled_once_two_others_find_it_failed(
    customer, serving_host, scorers, settings
) -> None:
    before = ledger.customer_account(user=customer.user).balance_ucents
    settings.AUDIT_PASS_RECHECK_RATE = 1.0
    settings.AUDIT_SCORER_MAX_OVERRULED = 1
    audit = _audited(customer, serving_host, settings)
    _claim(scorers[0])
    assert _verdict(scorers[0], audit.pk, "passed") == "pending"  # the colluder's pass
    _claim(scorers[1])
    present(scorers[2])
    assert (
        _verdict(scorers[1], audit.pk, "failed", "2 of 3 tokens miss") == "pending"
    )  # a split: to a third the gateway chooses
    assert not AuditScore.objects.filter(audit=audit, overruled=True).exists()  # (a 1-1 strikes nobody)
    confirming = _claim(scorers[2])
    assert confirming["draw"] is None  # every token
    assert _verdict(scorers[2], audit.pk, "failed", "2 of 3 tokens miss") == Audit.Status.FAILED
    serving_host.host.refresh_from_db()
    scorers[0].host.refresh_from_db()
    assert serving_host.host.maintenance_since is not None  # the cheat is caught
    assert ledger.customer_account(user=customer.user).balance_ucents == before  # and its customer refunded
    colluder = AuditScore.objects.get(audit=audit, scorer=scorers[0].host)
    assert colluder.overruled and colluder.paid_ucents == 0 and scorers[0].host.trusted_at is None  # it scores no more
    paid = {s.scorer_id: s.paid_ucents for s in AuditScore.objects.filter(audit=audit)}
    assert paid == {
        scorers[0].host.pk: 0,
        scorers[1].host.pk: _balance(scorers[1].host),
        scorers[2].host.pk: _balance(scorers[2].host),
    }  # the two that stand: what the platform could
    assert ledger.reconcile_report() == []


def test_a_pass_no_second_scorer_looks_at_in_time_stands_and_is_paid(customer, serving_host, scorers, settings) -> None:
    settings.AUDIT_PASS_RECHECK_RATE = 1.0
    audit = _audited(customer, serving_host, settings)
    _claim(scorers[0])
    assert _verdict(scorers[0], audit.pk, "passed") == "pending"
    Audit.objects.filter(pk=audit.pk).update(
        created_at=timezone.now() - timedelta(seconds=settings.AUDIT_SCORER_WAIT_SECONDS + 1)
    )
    assert audits.audit_scorers_watch() == 1
    audit.refresh_from_db()
    assert audit.status == Audit.Status.PASSED and audit.checked == 3
    assert _balance(serving_host.host) == audit.host_ucents and _balance(scorers[0].host) > 0
    assert ledger.reconcile_report() == []


def test_a_pass_is_not_held_for_a_second_look_nobody_could_give(customer, serving_host, scorers, settings) -> None:
    """With every other trusted host of the scorer's owner or the audited host's, a pass drawn
    for a second look would only wait AUDIT_SCORER_WAIT_SECONDS and then stand: it decides at once."""
    settings.AUDIT_PASS_RECHECK_RATE = 1.0
    third_owner = scorers[2].host.owner
    Host.objects.filter(pk=scorers[1].host.pk).update(owner=scorers[0].host.owner)
    Host.objects.filter(pk=scorers[2].host.pk).update(owner=serving_host.host.owner)
    audit = _audited(customer, serving_host, settings)
    _claim(scorers[0])
    assert _verdict(scorers[0], audit.pk, "passed") == Audit.Status.PASSED
    assert _balance(serving_host.host) == audit.host_ucents
    Host.objects.filter(pk=scorers[2].host.pk).update(owner=third_owner)  # a third owner's host: it can look
    second = _audited(customer, serving_host, settings)
    _claim(scorers[0])
    assert _verdict(scorers[0], second.pk, "passed") == "pending"


def test_with_the_default_share_a_pass_decides_most_audits_at_once(customer, serving_host, scorers, settings) -> None:
    settings.AUDIT_PASS_RECHECK_RATE = 0.1
    decided = 0
    for _ in range(10):
        audit = _audited(customer, serving_host, settings)
        _claim(scorers[0])
        decided += _verdict(scorers[0], audit.pk, "passed") == Audit.Status.PASSED
        if Audit.objects.get(pk=audit.pk).status == Audit.Status.PENDING:
            _claim(scorers[1])
            assert _verdict(scorers[1], audit.pk, "passed") == Audit.Status.PASSED
    assert decided >= 5  # 1 in 10 waits on average: that 6 or more of 10 wait is a chance under 2 in 10,000
