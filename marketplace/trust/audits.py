"""Audits: a random share of real jobs re-read under the real model before their host is paid.

Every chat and completion job is sampled with one specified sampler (`protocol.sampling`)
from a seed the gateway fixes (`job_seed`: the customer's `seed`, else a keyed hash of the
job's id), so anyone who holds the model can tell whether a token is the one that seed's
draw selects. Mahout reports the token ids it generated with its completion.

At completion (`audit_open`, in the settlement's transaction) a job is chosen for an audit
with probability `AUDIT_RATE`, or `AUDIT_PROBATION_RATE` for a host in probation. A chosen
job settles as any other (the customer's answer and bill are not delayed) except that the
host's share goes to the audit escrow. The rendered prompt, the delivered text and the
tokens wait on the `Audit` row; the request's own copy is deleted as for every job.

A Celery worker (`audit_scoring.audit_score_pending`) loads the model and re-reads the answer in one
prefill pass (`scorer.verify.Verifier`): every token checked must be the seed's draw under
the model's logits, within a tolerance for honest machines' arithmetic. AUDIT_TOKENS tokens
are checked, drawn at random (the host cannot know which), not every one: a large
vocabulary's output head is most of an every-token audit's cost. A pass pays the host
out of the escrow; a failure refunds the customer (the host's share from the escrow, the
platform's from its revenue), puts the host in maintenance with the evidence and forfeits
its unvested earnings. Either way the prompt, text and tokens are deleted then.

What is auditable (`scorer.verify.auditable`): chats and completions, under a grammar
(`response_format`, tools) or not, first attempts and continuations (the continuation's own
text, against the payload it was sent; rings and MoE coordinators heal resumed text as a
host does, mahout 0.7.0), on a model whose weights the gateway has
(`catalog.tokenizer.weights_on_gateway`) or that an independent trusted host could score
(`scorers_exist`). A chosen job whose host reported no tokens fails: a current mahout always
reports them. A ring's final text is audited as any job's (its stages draw by the specified
sampler, `mahout.ring.vocab`, top_p < 1 included; a ring that reports no tokens fails as any
host):
every host's share of it waits in the escrow, its stage hosts' with its bridge's, and a
failure refunds the customer all of it. A ring of several hosts then opens an inquiry
(`marketplace.trust.ring_inquiries`): its stages hand over what they kept of the request and a
trusted host outside the ring recomputes each stage, so the stage (or the bridge) at fault
is blamed, not whoever delivered the text.

Scored by hosts (`by_hosts`: the gateway lacks the model's weights, the normal case for a big
model an operator does not hold). The audit becomes work a trusted host claims through the
ordinary claim path (`audit_claim_payload`, after customers' jobs: kind "audit",
`protocol.jobs.AuditPayload`), a host that is present, accepting, qualified for the model on
its machine, and independent: never of the audited host's owner (however long the audit
waits), never of an owner whose host gave a verdict on it already (each verdict is another
owner's vote), and of an owner with a history (`reputation.scorer_owner_seasoned`: an account
AUDIT_SCORER_OWNER_MIN_AGE_DAYS old whose own hosts passed AUDIT_SCORER_OWNER_MIN_PASSED_AUDITS
audits; an e-mail is free, a vote must not be). The audited host sees nothing: its own
traffic is unchanged, and the scorer is not told whose answer it reads. The scorer answers
with a verdict (`audit_verdict_report`), and the verdicts decide by majority:
- a lone pass decides the audit: the escrow is released to the audited host; except that a
  share of first passes (AUDIT_PASS_RECHECK_RATE, drawn when the pass comes in, so no scorer
  can know) waits for a second scorer's look, when an independent host of a third owner holds
  the model (with none, the pass decides: waiting would only delay the host's share);
- a failure is only believed once a second scorer confirms it: then the customer is refunded
  and the host punished as above;
- two verdicts alike decide: two passes, or two failures; a third verdict after a split
  decides 2-1, and the scorer in the minority is overruled (a strike:
  AUDIT_SCORER_MAX_OVERRULED strikes in a day and it loses its trust, so it scores no more);
- a pass/fail split is nobody's majority (no strike): the gateway's own verifier decides it
  where it holds the weights (its verdict and the scorer it agrees with are the majority),
  else a third scorer the gateway chooses (`_split_break`: a random owner among the
  independent ones with a history, neither the audited host's nor either scorer's; only that
  host may claim it), so a second account can neither overrule an honest scorer nor race to
  be the third;
- a decline (it cannot score it there), a silence past AUDIT_SCORE_TIMEOUT_SECONDS or the
  scorer's restart (a new boot id from it, `audit_scorer_restarted`) hands the audit to
  another scorer. A scorer that declined or abandoned AUDIT_SCORER_MAX_DECLINED audits of one
  model for one cause in a day (`decline_cause`: the answer cannot be audited anywhere, or the
  scorer's own) is handed no more of that model that day: letting one go is unpaid, and it
  must not let a scorer choose which answers it reads; one model's declines do not stop its
  scoring of the others.
An audit no verdict decided within AUDIT_SCORER_WAIT_SECONDS goes to the gateway's verifier
where it holds the weights; a lone pass stands (a second look nobody gave); anything else
is unscored (`audit_unscored`).

No job is paid unchecked. An audit nobody independent could read (no such scorer in time, a
split nobody broke, the gateway's verifier unable to read it) is unscored: the customer is
refunded what the job cost and the host's share in escrow is voided with it, without a
strike or maintenance. Paying it would pay a cheat for being unreadable (it could make
itself so); blaming the host would punish an honest one for the want of scorers. What made
most such audits before, an answer longer than the verifier's context, is refused at
admission now (`CatalogModel.context_sold`), so an unscored audit is rare and costs an honest
host one job's share, never its standing. The gateway's verifier hands an audit whose weights
vanished to independent host scorers, where there are any (`audit_scoring.audit_score_pending`).
Each scorer whose verdict stands is paid its prefill's fee when the audit is decided
(`scorer_fee`: the model's prompt price for prompt + answer tokens, the host's share of it),
out of the platform's revenue, at most half the audited job's platform share each (10% of
what the customer paid, at the default 80/20 split) and never more than the platform holds.
A scorer whose verdict falls (overruled, or any verdict of an unscored audit) is not paid.
The prompt, text and tokens are deleted when the audit is decided, as for every audit.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import random
from collections import Counter
from collections.abc import Callable
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from billing import services as billing
from catalog.models import CatalogModel
from catalog.tokenizer import weights_on_gateway
from core.errors import ApiError
from core.events import announce_on_commit, queue_group
from hosts.models import TRUSTED, Host, HostQuerySet
from marketplace.models import Audit, AuditScore, Job, Request, StageShare
from marketplace.trust import reputation, ring_inquiries
from marketplace.trust.scorer_fees import scorer_fee
from mesh.experts import services as expert_services
from protocol.jobs import AUDIT, AUDIT_DECLINED_UNAUDITABLE, AuditPayload, JobPayload

logger = logging.getLogger(__name__)

MAX_TOKENS_KEPT = 16_384  # token ids a completion may report (more than any context a host runs)


def job_seed(*, job_id: int, params: dict) -> int:
    """The job's sampling seed: the customer's `seed` (reproducible answers), else a hash of
    the job's id keyed with the gateway's secret, so a host cannot predict another job's."""
    if params.get("seed") is not None:
        return int(params["seed"])
    digest = hmac.new(settings.SECRET_KEY.encode(), f"job-seed:{job_id}".encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # 63 bits: a signed 64-bit column holds it


def audit_rate(*, host: Host) -> float:
    """The chance that one of `host`'s jobs is audited: every job of a host in probation
    (by default), a few percent of a trusted host's."""
    if not settings.AUDIT_ENABLED:
        return 0.0
    return settings.AUDIT_RATE if host.trusted_at is not None else settings.AUDIT_PROBATION_RATE


def audit_weights(model: CatalogModel, *, assemble: bool = True) -> str | None:
    """The weights audits of `model` are read with (None: the gateway cannot audit it)."""
    return weights_on_gateway(tokenizer=model.tokenizer, weights_path=model.weights_path, assemble=assemble)


def audit_wanted(
    *,
    request: Request,
    job: Job,
    host: Host,
    payload: Callable[[], JobPayload],
    excluded: Callable[[JobPayload], bool],
    always: bool = False,
) -> JobPayload | None:
    """The job as its host received it when this completed job is to be audited (the draw
    says so, or `always`: a canary judged by its audit; and it can be), else None. `payload`
    and `excluded` (asked about that payload: a canary judged by its reference) cost queries, so they are
    asked only for a job the draw chose."""
    if request.kind not in (Request.Kind.CHAT, Request.Kind.COMPLETION):
        return None
    if not always and random.random() >= audit_rate(host=host):
        return None
    if not audit_possible(request.model, besides=host):
        return None
    from scorer.verify import auditable  # (imports llama_cpp's bindings: only when a job is drawn)

    job_as_sent = payload()
    return job_as_sent if auditable(job_as_sent) and not excluded(job_as_sent) else None


def audit_open(
    *,
    request: Request,
    job: Job,
    host: Host,
    payload: JobPayload,
    text: str,
    token_ids: list[int] | None,
    finish_reason: str,
    host_ucents: int,
    platform_ucents: int,
    logprobs: list[dict] | None = None,
) -> Audit:
    """Keep what the audit needs (the job, its answer, tokens and reported log-probabilities)
    beside the escrowed shares. In the settlement's transaction."""
    by_hosts = audit_weights(request.model, assemble=False) is None
    audit = Audit.objects.create(
        job=job,
        host=host,
        request=request,
        host_ucents=host_ucents,
        platform_ucents=platform_ucents,
        seed=int(payload["params"]["seed"]),
        payload=payload,
        text=text,
        token_ids=token_ids,
        finish_reason=finish_reason,
        logprobs=logprobs,
        by_hosts=by_hosts,
    )
    if by_hosts:
        announce_on_commit(queue_group(request.model_id), {"type": "audit.queued"})  # waiting scorers look now
    return audit


def audit_possible(model: CatalogModel, *, besides: Host) -> bool:
    """Whether a job of `model` that `besides` served could be audited: the gateway has the
    weights, or an independent host could score it (`scorers_exist`)."""
    return audit_weights(model, assemble=False) is not None or scorers_exist(model_id=model.pk, besides=besides)


def scorers_exist(*, model_id: int, besides: Host) -> bool:
    """Whether a host that may score an answer of `besides` has qualified `model_id`: one
    that could score an audit of it when the gateway cannot (`independent_scorers`)."""
    return independent_scorers(model_id=model_id, owners={besides.owner_id}).exists()


def independent_scorers(*, model_id: int, owners: set[int], now: datetime | None = None) -> HostQuerySet:
    """The hosts that may score an audit of `model_id` that none of `owners` (the audited
    host's, and those of the scorers that gave a verdict on it) may: trusted, qualified for
    the model, of another owner, and that owner with a history (`reputation.scorer_owner_seasoned`)."""
    return Host.objects.filter(
        TRUSTED.q(), reputation.scorer_owner_seasoned(now=now), qualifications__model_id=model_id
    ).exclude(owner_id__in=owners)


@transaction.atomic
def _gateway_decides(audit: Audit, *, reason: str | None, counts: dict) -> bool:
    """The gateway's verifier decides (an audit it holds the weights of, or a split of host
    scorers handed to it, `_split_break`). Its verdict is one vote: with a host scorer's
    alike, a majority, and the scorer against it is overruled (a strike); against a lone host
    verdict nobody is struck (a 1-1). Host scorers whose verdict stands are paid."""
    if not audit_decide(audit=audit, reason=reason, counts=counts):
        return False
    scores = list(audit.scores.filter(verdict__in=VERDICTS).select_related("scorer"))
    standing = [score for score in scores if (score.verdict == AuditScore.Verdict.PASSED) == (reason is None)]
    if len(standing) + 1 > len(scores) - len(standing) and standing:  # the gateway and one alike: a majority
        for score in scores:
            if score not in standing:
                _scorer_overruled(score)
    _scorers_pay(audit, standing)
    return True


def _audit_to_hosts(audit: Audit, *, why: str) -> bool:
    """The gateway can no longer read the model: independent host scorers do, as for a model it
    never held (`by_hosts`); with none, the audit is unscored now. True when decided so."""
    if not scorers_exist(model_id=audit.request.model_id, besides=audit.host):
        return audit_unscored(audit=audit, why=f"{why}, and no independent host could score it")
    logger.warning("audit %s: %s; independent hosts score it", audit.pk, why)
    Audit.objects.filter(pk=audit.pk, status=Audit.Status.PENDING).update(by_hosts=True)
    announce_on_commit(queue_group(audit.request.model_id), {"type": "audit.queued"})
    return False


@transaction.atomic
def audit_unscored(*, audit: Audit, why: str) -> bool:
    """Nobody independent could read the answer (see the module's docstring): the customer is
    refunded what the job cost, the host's escrowed share voided with it (a ring's stages'
    too), with no strike, maintenance or inquiry, and no scorer paid. Deletes the prompt, text
    and tokens. A compare-and-set from pending: False when decided elsewhere."""
    if not Audit.objects.filter(pk=audit.pk, status=Audit.Status.PENDING).update(
        status=Audit.Status.UNSCORED,
        reason=why[:500],
        payload=None,
        text="",
        token_ids=None,
        logprobs=None,
        decided_at=timezone.now(),
        scorer=None,
        scorer_since=None,
        scorer_boot="",
        chosen=None,
        chosen_at=None,
    ):
        return False
    request = audit.request
    logger.warning(
        "audit %s of request %s is unscored (%s): its customer is refunded, its host not paid",
        audit.pk,
        request.public_id,
        why,
    )
    billing.audit_refund(
        user=request.user,
        host_ucents=audit.host_ucents,
        platform_ucents=audit.platform_ucents,
        reference=f"audit-{audit.pk}",
        memo=f"request {request.public_id} refunded: no independent scorer could check its answer",
    )
    return True


@transaction.atomic
def audit_decide(*, audit: Audit, reason: str | None, counts: dict) -> bool:
    """Record the verdict once (a compare-and-set from pending) and move the money: the
    escrowed share to the host, or everything back to the customer and the host into
    maintenance with the evidence. Deletes the prompt, text and tokens. False when
    decided elsewhere."""
    status = Audit.Status.PASSED if reason is None else Audit.Status.FAILED
    if not Audit.objects.filter(pk=audit.pk, status=Audit.Status.PENDING).update(
        status=status,
        reason=(reason or "")[:500],
        payload=None,
        text="",
        token_ids=None,
        logprobs=None,
        decided_at=timezone.now(),
        scorer=None,
        scorer_since=None,
        scorer_boot="",
        chosen=None,
        chosen_at=None,
        **counts,
    ):
        return False
    request = audit.request
    if reason is None:
        for host, amount, reference in _audited_payees(audit):
            billing.audit_release(
                host=host,
                amount_ucents=amount,
                reference=reference,
                memo=f"audit of request {request.public_id} passed",
            )
        return True
    billing.audit_refund(
        user=request.user,
        host_ucents=audit.host_ucents,
        platform_ucents=audit.platform_ucents,
        reference=f"audit-{audit.pk}",
        memo=f"request {request.public_id} refunded: its host failed verification",
    )
    if ring_inquiries.inquiry_open(audit=audit, reason=reason):  # a ring of several hosts: find whose fault first
        return True
    excuse = expert_services.coordinator_failure_excuse(
        host=audit.host, model_name=request.model.name, since=request.created_at
    )
    if excuse is not None:  # an expert mesh's volunteers helped: the coordinator is given one excuse
        logger.warning(
            "audit %s of request %s failed (%s) and is excused: %s", audit.pk, request.public_id, reason, excuse
        )
        return True
    ring_inquiries.host_blame(
        host=audit.host, why=f"Failed verification: {reason} (audit {audit.pk} of request {request.public_id})."
    )
    return True


def _audited_payees(audit: Audit) -> list[tuple[Host, int, str]]:
    """Who is paid what out of the escrow when the audit passes (with the ledger reference):
    the audited host, and a ring's stage hosts their shares (`StageShare`), escrowed with its
    bridge's since a ring's answer is audited whole."""
    stages = list(StageShare.objects.filter(job_id=audit.job_id).select_related("host"))
    own = audit.host_ucents - sum(stage.earned_ucents for stage in stages)
    return [
        (audit.host, own, f"audit-{audit.pk}"),
        *((stage.host, stage.earned_ucents, f"audit-{audit.pk}-stage-{stage.host_id}") for stage in stages),
    ]


def audit_summary() -> dict:
    """Audits by status, the models trusted hosts verify (the gateway lacks their weights),
    those nobody can verify (no weights on the gateway and no trusted host with a history
    qualified: `independent_scorers`), and the
    ring inquiries open and decided (`marketplace.trust.ring_inquiries`)."""
    counts = {status: Audit.objects.filter(status=status).count() for status in Audit.Status.values}
    by_hosts: list[str] = []
    unverifiable: list[str] = []
    for model in CatalogModel.objects.filter(active=True, kind=CatalogModel.Kind.CHAT):
        if audit_weights(model, assemble=False) is None:
            scored = independent_scorers(model_id=model.pk, owners=set()).exists()
            (by_hosts if scored else unverifiable).append(model.name)
    inquiries = ring_inquiries.inquiry_summary()
    return {
        **counts,
        "verified_by_hosts_models": by_hosts,
        "unverifiable_models": unverifiable,
        "ring_inquiries_open": inquiries["collecting"] + inquiries["checking"],
        "ring_inquiries_decided": inquiries["decided"],
    }


# --- scoring by trusted hosts (claimed through the host claim path) --------------------------

CLAIM_CANDIDATES = 5  # audits a claim tries before giving up to a race
VERDICTS = (AuditScore.Verdict.PASSED, AuditScore.Verdict.FAILED)  # what a scorer says of the answer (not a decline)
LET_GO = (AuditScore.Verdict.DECLINED, AuditScore.Verdict.ABANDONED)  # an audit a scorer took and gave back


def audit_claim_payload(*, host: Host, model_ids: list[int], boot: str = "") -> AuditPayload | None:
    """An audit of one of `model_ids` (the models `host` qualified on its machine) for this
    trusted host to score, claimed with a compare-and-set, or None. Oldest first; only an
    independent one (see the module's docstring): never an answer of its own owner's hosts,
    nor one its owner's hosts gave a verdict on, nor one it let go before, nor one the gateway
    chose another scorer for (a split); only while its owner has a history
    (`reputation.scorer_owner_seasoned`), and not of a model it let too many audits of go
    today (`scorer_declines_capped`). The claim path asks only when no customer's job was
    there for it. `boot` (the claiming process's boot id) is kept: a new one from this host
    frees the audit at once (`audit_scorer_restarted`)."""
    if host.trusted_at is None or host.banned_at is not None or not model_ids:
        return None
    now = timezone.now()
    candidates = _claimable(host=host, model_ids=model_ids)  # (idle, this one query is all an audit costs a claim)
    if not candidates:
        return None
    if Audit.objects.filter(scorer_id=host.pk, status=Audit.Status.PENDING).exists():
        return None  # one at a time: a scorer is not a queue of audits nobody else may take
    if not Host.objects.filter(reputation.scorer_owner_seasoned(now=now), pk=host.pk).exists():
        return None  # a new account scores nothing until it has a history
    capped = scorer_declines_capped(host_id=host.pk, now=now)
    if capped & {model_id for _, model_id in candidates}:  # it lets too many of those go: the others' audits only
        candidates = _claimable(host=host, model_ids=[model_id for model_id in model_ids if model_id not in capped])
    for audit_id, _ in candidates:
        if Audit.objects.filter(_open_to(host), pk=audit_id, status=Audit.Status.PENDING, scorer__isnull=True).update(
            scorer=host, scorer_since=now, scorer_boot=boot
        ):
            return _audit_payload(Audit.objects.select_related("request__model").get(pk=audit_id))
    return None


def _open_to(host: Host) -> Q:
    """Audits `host` may take, as far as the gateway's choice goes: any, but a split's, whose
    scorer the gateway chose (`_split_break`; `chosen_at` set, `chosen` None while it found none)."""
    return Q(chosen_at__isnull=True) | Q(chosen_id=host.pk)


def _claimable(*, host: Host, model_ids: list[int]) -> list[tuple[int, int]]:
    """The oldest pending audits of `model_ids` that `host` may score, as (audit id, model id)."""
    if not model_ids:
        return []
    return list(
        Audit.objects.filter(
            _open_to(host),
            status=Audit.Status.PENDING,
            by_hosts=True,
            scorer__isnull=True,
            request__model_id__in=model_ids,
        )
        .exclude(host__owner_id=host.owner_id)
        .exclude(scores__scorer_id=host.pk)
        .exclude(
            pk__in=AuditScore.objects.filter(scorer__owner_id=host.owner_id, verdict__in=VERDICTS).values("audit_id")
        )
        .order_by("created_at")
        .values_list("pk", "request__model_id")[:CLAIM_CANDIDATES]
    )


def decline_cause(*, verdict: str, reason: str) -> str:
    """Why a scorer let an audit go: "unauditable" (it says the answer cannot be audited
    anywhere: `protocol.jobs.AUDIT_DECLINED_UNAUDITABLE`, the verifier's own refusal) or
    "scorer" (its own means: a runner that cannot read it, an error, a silence, a restart)."""
    if verdict == AuditScore.Verdict.DECLINED and reason.startswith(AUDIT_DECLINED_UNAUDITABLE):
        return "unauditable"
    return "scorer"


def scorer_declines_today(*, host_id: int, now: datetime) -> Counter[tuple[int, str]]:
    """How many audits this scorer let go in the last day, per (model id, `decline_cause`):
    declined, or abandoned (silent past AUDIT_SCORE_TIMEOUT_SECONDS, or restarted). Silence is
    a decline that takes longer: counted alike, or a colluder would wait instead of declining.
    Per model, so that one model's answers no scorer can read (or a model its runner cannot
    read) do not stop its scoring of the others; per cause, so that declines the answers
    caused do not use up what the scorer's own may, nor the other way round."""
    rows = AuditScore.objects.filter(
        scorer_id=host_id, verdict__in=LET_GO, created_at__gte=now - timedelta(days=1)
    ).values_list("audit__request__model_id", "verdict", "reason")
    return Counter((model_id, decline_cause(verdict=verdict, reason=reason)) for model_id, verdict, reason in rows)


def scorer_declines_capped(*, host_id: int, now: datetime) -> set[int]:
    """The models this scorer is handed no audits of today: for one cause, it let
    AUDIT_SCORER_MAX_DECLINED of them go in the last day (`scorer_declines_today`)."""
    return {
        model_id
        for (model_id, _), count in scorer_declines_today(host_id=host_id, now=now).items()
        if count >= settings.AUDIT_SCORER_MAX_DECLINED
    }


def _audit_payload(audit: Audit) -> AuditPayload:
    """What the scorer receives: the audited job as its host received it (without its id) and
    that host's answer; nothing names that host. The first scorer checks AUDIT_TOKENS tokens
    drawn at random; one reading an answer another scorer failed (a confirmation, or a split's
    third) checks every token, so that a miss the first found cannot escape a second draw."""
    job = {key: value for key, value in (audit.payload or {}).items() if key != "id"}
    confirming = audit.scores.filter(verdict=AuditScore.Verdict.FAILED).exists()
    return {
        "id": audit.pk,
        "model": audit.request.model.name,
        "kind": AUDIT,
        "job": job,  # type: ignore[typeddict-item]
        "tokens": [int(t) for t in audit.token_ids or []],
        "text": audit.text,
        "finish_reason": audit.finish_reason,
        "seed": audit.seed,
        "logprobs": audit.logprobs,
        "draw": None if confirming or not settings.AUDIT_TOKENS else settings.AUDIT_TOKENS,
    }


@transaction.atomic
def audit_verdict_report(
    *, host: Host, audit_id: int, verdict: str, reason: str = "", counts: dict | None = None
) -> str:
    """A scorer's verdict on the audit it claimed (`protocol.jobs.AuditVerdict`); decides the
    audit when the rules say so (see the module's docstring). Returns the audit's status
    after it. An audit that is not this host's to score (any more) is a 409."""
    audit = Audit.objects.select_for_update().select_related("request__model", "host").filter(pk=audit_id).first()
    if audit is None or audit.scorer_id != host.pk or audit.status != Audit.Status.PENDING:
        raise ApiError(
            409,
            f"Audit {audit_id} is not this host's to score (decided, reassigned or never claimed).",
            code="audit_not_yours",
            type="invalid_request_error",
        )
    counts = {key: max(int((counts or {}).get(key) or 0), 0) for key in ("checked", "uncertain", "misses")}
    score = AuditScore.objects.create(audit=audit, scorer=host, verdict=verdict, reason=reason[:500], **counts)
    Audit.objects.filter(pk=audit.pk).update(scorer=None, scorer_since=None, scorer_boot="")
    if verdict == AuditScore.Verdict.DECLINED:
        logger.info("audit %s: host %s declined to score it (%s)", audit.pk, host.pk, reason)
    _audit_settle_scores(audit, newest=score)
    audit.refresh_from_db(fields=["status"])
    return audit.status


def _audit_settle_scores(audit: Audit, *, newest: AuditScore) -> None:
    """Decide from the verdicts so far (each another owner's), by majority: a lone pass
    decides (but one drawn for a second look, drawn only as it comes in); two alike, more
    than the other, decide, and the verdict against them is overruled (a strike); a lone
    failure waits for its confirmation; a pass/fail split, nobody's majority and no strike,
    goes to the gateway's verifier or a third scorer the gateway chooses (`_split_break`).
    Otherwise the audit goes back to the scorers (announced, so a waiting one claims it now)."""
    scores = list(audit.scores.filter(verdict__in=VERDICTS).select_related("scorer").order_by("created_at", "pk"))
    passes = [score for score in scores if score.verdict == AuditScore.Verdict.PASSED]
    fails = [score for score in scores if score.verdict == AuditScore.Verdict.FAILED]
    lone_pass = (
        len(passes) == 1
        and not fails
        and newest.pk == passes[0].pk
        and (random.random() >= settings.AUDIT_PASS_RECHECK_RATE or not _second_look_possible(audit, passes[0]))
    )
    if lone_pass or len(passes) >= 2 and len(passes) > len(fails):
        decided, standing, fallen = audit_decide(audit=audit, reason=None, counts=_counts(passes[-1])), passes, fails
    elif len(fails) >= 2 and len(fails) > len(passes):
        decided = audit_decide(
            audit=audit, reason=fails[0].reason or "failed under two scorers", counts=_counts(fails[0])
        )
        standing, fallen = fails, passes
    elif passes and fails:
        _split_break(audit, owners={audit.host.owner_id, *(score.scorer.owner_id for score in scores)})
        return
    else:
        announce_on_commit(queue_group(audit.request.model_id), {"type": "audit.queued"})
        return
    for score in fallen:  # the minority of a majority verdict
        _scorer_overruled(score)
    if decided:
        _scorers_pay(audit, standing)


def _split_break(audit: Audit, *, owners: set[int], now: datetime | None = None) -> None:
    """A pass/fail split (`owners`: the audited host's and the scorers'): the gateway's own
    verifier decides it where it holds the model's weights (`_gateway_decides`); else the
    gateway chooses the third scorer, so that no second account can race to be it: an owner
    drawn at random among the independent ones with a history that have a present host of
    the model, then one of its hosts; only that host may claim the audit. With none, nobody may
    claim it and `audit_scorers_watch` chooses again; one chosen that has not claimed it within
    AUDIT_SCORE_TIMEOUT_SECONDS is replaced so too."""
    now = now or timezone.now()
    if audit_weights(audit.request.model, assemble=False) is not None:
        logger.info("audit %s: its scorers disagree; the gateway's verifier decides", audit.pk)
        Audit.objects.filter(pk=audit.pk, status=Audit.Status.PENDING).update(
            by_hosts=False, chosen=None, chosen_at=None
        )
        return
    pool = (
        independent_scorers(model_id=audit.request.model_id, owners=owners, now=now)
        .online(now)
        .exclude(audit_scores__audit_id=audit.pk)
    )  # (not one that let it go)
    draw = random.SystemRandom()
    by_owner: dict[int, list[int]] = {}
    for host_id, owner_id in pool.values_list("pk", "owner_id").distinct():
        by_owner.setdefault(owner_id, []).append(host_id)
    chosen = draw.choice(by_owner[draw.choice(sorted(by_owner))]) if by_owner else None
    Audit.objects.filter(pk=audit.pk, status=Audit.Status.PENDING).update(chosen_id=chosen, chosen_at=now)
    if chosen is not None:
        logger.info("audit %s: its scorers disagree; host %s is chosen to break the split", audit.pk, chosen)
        announce_on_commit(queue_group(audit.request.model_id), {"type": "audit.queued"})


def _second_look_possible(audit: Audit, score: AuditScore) -> bool:
    """Whether an independent host of a third owner (neither the scorer's nor the audited
    host's) holds the model: with none, a pass drawn for a second look would only wait
    AUDIT_SCORER_WAIT_SECONDS, the host's share with it, and then stand anyway."""
    owners = set(Host.objects.filter(pk__in=[score.scorer_id, audit.host_id]).values_list("owner_id", flat=True))
    return independent_scorers(model_id=audit.request.model_id, owners=owners).exists()


def _counts(score: AuditScore) -> dict:
    return {"checked": score.checked, "uncertain": score.uncertain, "misses": score.misses}


def _scorer_overruled(score: AuditScore) -> None:
    """A strike: the scorer's verdict was in the minority of a majority verdict (a 2-1, the
    gateway's verifier counting as one). AUDIT_SCORER_MAX_OVERRULED strikes in a day and it
    goes back to probation (it no longer scores, and must earn trust again)."""
    AuditScore.objects.filter(pk=score.pk).update(overruled=True)
    strikes = AuditScore.objects.filter(
        scorer_id=score.scorer_id, overruled=True, created_at__gte=timezone.now() - timedelta(days=1)
    ).count()
    logger.warning(
        "audit %s: host %s's verdict (%s) was overruled by other scorers (%s strike(s) today)",
        score.audit_id,
        score.scorer_id,
        score.verdict,
        strikes,
    )
    if strikes >= settings.AUDIT_SCORER_MAX_OVERRULED:
        reputation.trust_revoke(host_id=score.scorer_id)


def _scorers_pay(audit: Audit, scores: list[AuditScore]) -> None:
    """Pay the scorers whose verdicts stand (one, or the two of a majority), from the
    platform's revenue: each at most half the audited job's platform share, so a passing
    audit never costs the platform more than that job brought it (a confirmed failure's fees
    come on top of the refund: the platform bears them, never beyond what it holds)."""
    for score in scores:
        fee = min(scorer_fee(audit.request), audit.platform_ucents // 2)
        paid = (
            billing.audit_score_pay(
                host=score.scorer,
                amount_ucents=fee,
                reference=f"audit-{audit.pk}-score-{score.pk}",
                memo=f"scored audit {audit.pk}",
            )
            if fee > 0
            else 0
        )
        AuditScore.objects.filter(pk=score.pk).update(paid_ucents=paid)


def audit_scorers_watch(*, now: datetime | None = None) -> int:
    """The periodic part (with the Celery workers' scoring): a scorer silent past
    AUDIT_SCORE_TIMEOUT_SECONDS loses its audit to another; a split whose chosen scorer has not
    claimed it that long (or that found none) gets another; an audit scored by hosts that no
    verdict decided within AUDIT_SCORER_WAIT_SECONDS is settled as the module's docstring says
    (never released unchecked). Returns how many were decided."""
    now = now or timezone.now()
    silent = now - timedelta(seconds=settings.AUDIT_SCORE_TIMEOUT_SECONDS)
    for audit_id, scorer_id in list(
        Audit.objects.filter(status=Audit.Status.PENDING, by_hosts=True, scorer_since__lt=silent).values_list(
            "pk", "scorer_id"
        )
    ):
        _scorer_abandoned(
            audit_id=audit_id,
            scorer_id=scorer_id,
            why=f"gave no verdict within {settings.AUDIT_SCORE_TIMEOUT_SECONDS:.0f} s",
        )
    for audit in Audit.objects.select_related("request__model", "host").filter(
        Q(chosen__isnull=True) | Q(chosen_at__lt=silent),
        status=Audit.Status.PENDING,
        by_hosts=True,
        scorer__isnull=True,
        chosen_at__isnull=False,
    ):
        owners = {
            audit.host.owner_id,
            *audit.scores.filter(verdict__in=VERDICTS).values_list("scorer__owner_id", flat=True),
        }
        with transaction.atomic():
            _split_break(audit, owners=owners, now=now)
    decided = 0
    waited = now - timedelta(seconds=settings.AUDIT_SCORER_WAIT_SECONDS)
    for audit in Audit.objects.select_related("request__model", "host").filter(
        status=Audit.Status.PENDING, by_hosts=True, scorer__isnull=True, created_at__lt=waited
    ):
        decided += _audit_waited_out(audit)
    return decided


def _audit_waited_out(audit: Audit) -> bool:
    """No verdict decided the audit within AUDIT_SCORER_WAIT_SECONDS: a lone pass (a second
    look nobody gave) stands; else the gateway's verifier reads it where it holds the weights;
    else it is unscored. True when decided now."""
    scores = list(audit.scores.filter(verdict__in=VERDICTS).order_by("created_at", "pk"))
    if len(scores) == 1 and scores[0].verdict == AuditScore.Verdict.PASSED:
        logger.warning(
            "audit %s: no second scorer looked within %.0f s; its pass stands",
            audit.pk,
            settings.AUDIT_SCORER_WAIT_SECONDS,
        )
        with transaction.atomic():
            if not audit_decide(audit=audit, reason=None, counts=_counts(scores[0])):
                return False
            _scorers_pay(audit, scores)
        return True
    if audit_weights(audit.request.model, assemble=False) is not None:
        Audit.objects.filter(pk=audit.pk, status=Audit.Status.PENDING).update(
            by_hosts=False, chosen=None, chosen_at=None
        )
        return False  # (`audit_score_pending` reads it next)
    verdicts = ", ".join(score.verdict for score in scores) or "none"
    return audit_unscored(
        audit=audit,
        why=f"no independent scorer decided it within "
        f"{settings.AUDIT_SCORER_WAIT_SECONDS:.0f} s (verdicts: {verdicts})",
    )


def audit_scorer_restarted(*, host_id: int, boot: str) -> int:
    """The host spoke with boot id `boot` (`lifecycle.failover.host_boot_seen`): an audit it
    claimed from another process is never answered (that process is gone), so it goes to
    another scorer now, not after AUDIT_SCORE_TIMEOUT_SECONDS. Without a boot id nothing
    happens, and an audit claimed without one waits out the timeout. Returns how many were freed."""
    if not boot:
        return 0
    held = list(
        Audit.objects.filter(status=Audit.Status.PENDING, scorer_id=host_id)
        .exclude(scorer_boot__in=("", boot))
        .values_list("pk", "scorer_boot")
    )
    return sum(
        _scorer_abandoned(audit_id=audit_id, scorer_id=host_id, boot=old, why="restarted before its verdict")
        for audit_id, old in held
    )


@transaction.atomic
def _scorer_abandoned(*, audit_id: int, scorer_id: int | None, why: str, boot: str | None = None) -> bool:
    """Take the audit back from a scorer that will not answer (silent, dead or restarted; the
    claim of process `boot` only, when given) for another. False when it was not held so."""
    held = Audit.objects.filter(pk=audit_id, status=Audit.Status.PENDING, scorer_id=scorer_id)
    if boot is not None:
        held = held.filter(scorer_boot=boot)
    if scorer_id is None or not held.update(scorer=None, scorer_since=None, scorer_boot=""):
        return False
    AuditScore.objects.create(audit_id=audit_id, scorer_id=scorer_id, verdict=AuditScore.Verdict.ABANDONED)
    Audit.objects.filter(pk=audit_id, chosen_id=scorer_id).update(chosen=None)  # a split's: the watch chooses another
    logger.warning("audit %s: host %s %s; another scorer is asked", audit_id, scorer_id, why)
    model_id = Audit.objects.filter(pk=audit_id).values_list("request__model_id", flat=True).first()
    assert model_id is not None  # the audit it just updated
    announce_on_commit(queue_group(model_id), {"type": "audit.queued"})
    return True
