"""Money at the end of a request, written once (`settle`): the gateway's token count billed
at most the hold, the host share split 80% (a continuation's host paid for its own part, a
ring's share split by layers among its stage hosts), the hold settled, the prompt deleted.
A host's completion, an answer whole before its host died, and a request whose customer
left all settle through it. An answer that breaks what the request asked for is refused
here, unbilled.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db import transaction
from django.utils import timezone

from billing import services as billing
from catalog.pricing import price
from hosts.models import Host
from marketplace.lifecycle.answers import (
    answer_of,
    count_output,
    embeddings_checked,
    finish_reason_checked,
)
from marketplace.lifecycle.canaries import canary_check, canary_judge
from marketplace.lifecycle.claims import check_running, job_payload
from marketplace.lifecycle.errors import (
    BadResult,
    CompletionRefused,
    JobNotRunning,
    LogprobsMissing,
)
from marketplace.lifecycle.evidence import completion_checked
from marketplace.lifecycle.structured import answer_problem, answer_problem_ahead, answer_refusal
from marketplace.lifecycle.transitions import request_fail, request_settled
from marketplace.models import Job, Request, StageShare, TextChunk
from marketplace.trust import reputation
from marketplace.trust.audits import MAX_TOKENS_KEPT, audit_open, audit_wanted
from marketplace.trust.reputation import blame_corrected, host_rest_if_unreliable
from mesh.rings.models import RingPlan
from mesh.rings.selectors import ring_layers


@dataclass(frozen=True)
class Completion:
    request: Request
    earned_ucents: int


def job_complete(
    *,
    host: Host,
    job_id: int,
    finish_reason: str,
    embeddings: list | None = None,
    token_ids: list[int] | None = None,
) -> Completion:
    """`job_settle`, with a structured answer and the completion's evidence
    (`marketplace.lifecycle.evidence`) checked first, before any lock is taken. Raises
    `CompletionRefused` for a completion that is no evidence of its answer: the caller
    (`failover.job_complete`) ends the attempt then."""
    request = Request.objects.filter(jobs__pk=job_id, jobs__host=host).only("pk", "params").first()
    if request is not None and embeddings is None and request.params.get("response_format"):
        answer_problem_ahead(request.params["response_format"], answer_of(request, request.delivered_text)[0])
    job = (
        Job.objects.select_related("request__model", "model")
        .filter(pk=job_id, host=host, status=Job.Status.RUNNING)
        .first()
        if embeddings is None
        else None
    )
    checked, audit = None, False
    if job is not None and job.request.kind != Request.Kind.EMBEDDINGS:
        checked = own_text(job.request.delivered_text, job=job)
        verdict = completion_checked(
            request=job.request,
            job=job,
            own_text=checked,
            token_ids=token_ids,
            finish_reason=finish_reason,
            payload=lambda: job_payload(job),
        )
        if verdict.refusal is not None:
            raise CompletionRefused(
                f"Job {job_id}'s completion was refused: {verdict.refusal.reason}; nothing was paid.",
                proven=verdict.refusal.proven,
            )
        audit = verdict.audit
    return job_settle(
        host=host,
        job_id=job_id,
        finish_reason=finish_reason,
        embeddings=embeddings,
        token_ids=token_ids,
        checked_text=checked,
        audit=audit,
    )


@transaction.atomic
def job_settle(
    *,
    host: Host,
    job_id: int,
    finish_reason: str,
    embeddings: list | None = None,
    token_ids: list[int] | None = None,
    checked_text: str | None = None,
    audit: bool = False,
) -> Completion:
    """Settle the request: bill the counted tokens, pay the host 80%, delete the prompt.

    An embeddings job completes with its vectors (one per input, checked here) and is
    billed for its input tokens. Repeating the call for a job this host already
    completed (its answer was lost) returns the same result and changes nothing. The
    ledger posting comes last so the customer's hot balance row is locked only until
    the commit. A job chosen for an audit (`marketplace.trust.audits`) pays its host's share into
    the audit escrow and keeps `token_ids` (what the host says it generated) for the audit;
    `audit` chooses it always (its evidence needs weights the gateway lacks). `checked_text`:
    the host's own text when its evidence was checked (`job_complete`); text that landed
    since is refused.
    """
    job = (  # the job and its request locked in one statement, with what settling reads
        Job.objects.select_for_update(of=("self", "request"))
        .select_related("request", "request__model", "request__hold")
        .filter(pk=job_id)
        .first()
    )
    if job is not None and job.host_id == host.pk and job.status == Job.Status.COMPLETED:
        return Completion(request=job.request, earned_ucents=job.earned_ucents)
    job = check_running(job, host=host, job_id=job_id)
    request = job.request
    if request.kind == Request.Kind.EMBEDDINGS:  # all or nothing: whoever completes did all the work
        result, completion_tokens, share = embeddings_checked(request=request, vectors=embeddings), 0, None
    else:
        if embeddings is not None:
            raise BadResult(f"Job {job_id} is a {request.kind} job; it completes with text, not embeddings.")
        delivered = request.delivered_text
        if checked_text is not None and own_text(delivered, job=job) != checked_text:
            raise BadResult(f"Job {job_id} sent text after its completion was checked; complete it again.")
        text, stopped = answer_of(request, delivered)
        counted = count_output(request, text)
        max_tokens = int(request.params["max_tokens"])
        # An answer counting past max_tokens (and the slack) is no refusal: an honest host's
        # tokens can spell twice as many when counted again (a word token repeated at a
        # failover's seam). The customer got it cut at that limit (`streaming`), it is billed
        # max_tokens and ends "length"; a host generating past its budget gains nothing here,
        # and its audits replay the budget (`scorer.verify`).
        result, completion_tokens = None, min(counted, max_tokens)
        finish_reason = (
            "stop"
            if stopped
            else finish_reason_checked(
                claimed=finish_reason, completion_tokens=completion_tokens, max_tokens=max_tokens
            )
        )
        problem = answer_problem(request.params.get("response_format"), text) if finish_reason == "stop" else None
        if problem is not None:  # the host's failure, or the request's where its grammar let the answer through
            refused = answer_refusal(request.params, text, problem)
            return _answer_refused(
                job=job,
                request=request,
                why=refused.why,
                code=refused.code,
                message=refused.message,
                cause=refused.cause,
            )
        if (
            request.params.get("logprobs") is not None
            and TextChunk.objects.filter(job=job, logprobs__isnull=True).exists()
        ):
            return _answer_refused(
                job=job,
                request=request,
                why="sent text without the log-probabilities asked for",
                code=LogprobsMissing.code,
                message="The host did not report the log-probabilities asked "
                "for (mahout before 0.2.0 could not); nothing was billed.",
            )
        share = rescuer_share(request=request, job=job, text=delivered, completion_tokens=completion_tokens)
    check = canary_check(request=request) if request.kind != Request.Kind.EMBEDDINGS else None
    audited = audit_wanted(  # (a greedy canary is judged against its reference)
        request=request,
        job=job,
        host=host,
        payload=lambda: job_payload(job),
        always=audit or (check is not None and check.by_audit),
        excluded=lambda sent: check is not None and not check.by_audit,
    )
    now = timezone.now()
    settled = settle(
        request=request,
        completion_tokens=completion_tokens,
        finish_reason=finish_reason,
        job=job,
        host=host,
        share=share,
        result=result,
        now=now,
        escrow=audited is not None,
    )
    if settled is None:  # the hold closed under us (expired): roll all of this back, the job ends anyway
        raise JobNotRunning(f"Request {request.public_id} already ended.")
    if audited is not None:
        audit_open(
            request=request,
            job=job,
            host=host,
            payload=audited,
            text=own_text(request.delivered_text, job=job),
            token_ids=token_ids[:MAX_TOKENS_KEPT] if token_ids is not None else None,
            finish_reason=finish_reason,
            host_ucents=settled.cost_ucents - settled.platform_ucents,
            platform_ucents=settled.platform_ucents,
            logprobs=own_logprobs(request, job=job),
        )
    if request.kind != Request.Kind.EMBEDDINGS:  # only the host's own part of the answer says how fast it is
        own = completion_tokens if job.attempt == 1 else count_output(request, own_text(delivered, job=job))
        reputation.speed_measured(job=job, completion_tokens=own, now=now)
    if check is not None:
        canary_judge(
            check=check, host=host, text=text, completion_tokens=completion_tokens, audited=audited is not None
        )
    reputation.trust_review(host_id=host.pk, now=now)
    if job.requeue or job.attempt > 1:  # earlier attempts of this request exist: was one blamed on it wrongly?
        blame_corrected(request=request, host=host)
    request.status, request.completion_tokens, request.cost_ucents = (
        Request.Status.COMPLETED,
        completion_tokens,
        settled.cost_ucents,
    )
    request.finish_reason, request.messages, request.prompt, request.inputs = finish_reason, None, None, None
    request.result = result
    return Completion(request=request, earned_ucents=settled.earned_ucents)


def _answer_refused(
    *, job: Job, request: Request, why: str, code: str, message: str, cause: str = "host"
) -> Completion:
    """A finished answer that is not what the request asked for (it breaks its
    `response_format`, it lacks the log-probabilities asked for) is never passed on as a
    success: the request fails unbilled, and the attempt is the host's failure (it counts
    toward its rest), or with `cause` "request" the request's own (an answer its grammar let
    through: `structured.answer_refusal`), which no host is blamed for. No continuation: it
    would have to resume from that very text."""
    Job.objects.filter(pk=job.pk, status=Job.Status.RUNNING).update(
        status=Job.Status.FAILED, finished_at=timezone.now(), fail_reason=why[:500], fail_cause=cause
    )
    if cause != "request":
        host_rest_if_unreliable(host_id=job.host_id)
    request_fail(request=request, code=code, message=message)
    return Completion(request=request, earned_ucents=0)


def own_logprobs(request: Request, *, job: Job) -> list[dict] | None:
    """The log-probability entries `job`'s host reported with its batches, in order, when the
    request asked for them (None otherwise): what an audit compares with the model's."""
    if request.params.get("logprobs") is None:
        return None
    entries: list[dict] = []
    for batch in TextChunk.objects.filter(job=job).order_by("seq").values_list("logprobs", flat=True):
        entries.extend(batch or [])
    return entries[:MAX_TOKENS_KEPT]


def own_text(delivered: str, *, job: Job) -> str:
    """The part of the request's `delivered` text that `job`'s host generated (a continuation's
    host, only what follows the text it was sent)."""
    return delivered[len(delivered) - job.generated_chars :] if job.generated_chars else ""


def rescuer_share(*, request: Request, job: Job, text: str, completion_tokens: int) -> int | None:
    """A continuation host earns 80% of the output it generated itself; the
    first attempt's host (None here) earns the usual 80% of the whole cost."""
    if job.attempt == 1:
        return None
    own = own_text(text, job=job)
    own_tokens = min(count_output(request, own), completion_tokens)
    return billing.split_cost(price(request.model, prompt_tokens=0, completion_tokens=own_tokens)).host_ucents


def ring_memo(ring: tuple[RingPlan, dict[int, int]]) -> str:
    """A ring settlement's ledger memo: who ran how many of the ring's layers."""
    plan, layers = ring
    return f"ring {plan.pk}: " + ", ".join(
        f"host {host_id} {count}/{plan.n_layers} layers" for host_id, count in layers.items()
    )


def settle_without_host(*, request: Request, completion_tokens: int, finish_reason: str = "length") -> None:
    """Every allowed token, a stop sequence, or the host's word that its generation ended was
    delivered before the host died: the answer is whole, the customer pays for it, and no
    host is paid (none finished)."""
    settle(request=request, completion_tokens=completion_tokens, finish_reason=finish_reason)


@dataclass(frozen=True)
class Settlement:
    cost_ucents: int
    earned_ucents: int  # what the host that finished the job (a ring's bridge) was paid
    platform_ucents: int = 0  # the platform's share (less a ring's stage hosts' shares)


def settle(
    *,
    request: Request,
    completion_tokens: int,
    finish_reason: str,
    job: Job | None = None,
    host: Host | None = None,
    share: int | None = None,
    result: list | None = None,
    note: str = "",
    now: datetime | None = None,
    escrow: bool = False,
) -> Settlement | None:
    """Bill `completion_tokens` (at most the hold), end the request with `finish_reason` and
    post the ledger: the one settlement every ending that bills goes through.

    With a `host` (it finished `job`, a running attempt of `request`): the host share is
    `share` (a continuation's own part, `rescuer_share`) or 80% of the cost; a host that
    bridges a ring splits it by layers with its stage hosts, each paid and recorded as a
    `StageShare`. The job is completed by a compare-and-set (`note` becomes its
    `fail_reason`: why a job ended early still settled). Without a host, nobody is paid.
    `escrow`: the host's share waits in the audit escrow (`marketplace.trust.audits`).
    Returns None when the job was no longer running or the hold had already closed
    (someone else got there first). The ledger posting comes last, so the customer's hot
    balance row is locked only until the commit.
    """
    now = now or timezone.now()
    cost = min(
        price(
            request.model,
            prompt_tokens=request.prompt_tokens_billed,
            completion_tokens=completion_tokens,
            cached_tokens=request.cached_tokens_billed,
        ),
        request.hold.amount_ucents,
    )
    ring, paid, earned = None, {}, 0
    if host is not None and job is not None:
        hosts_share = share if share is not None else billing.split_cost(cost).host_ucents
        ring = ring_layers(bridge_host_id=host.pk, model_id=request.model_id)
        paid = billing.split_by_layers(hosts_share, ring[1]) if ring is not None else {host.pk: hosts_share}
        earned = paid.pop(host.pk)
        ended = {"fail_reason": note} if note else {}
        if not Job.objects.filter(pk=job.pk, status=Job.Status.RUNNING).update(
            status=Job.Status.COMPLETED,
            finished_at=now,
            completion_tokens=completion_tokens,
            earned_ucents=earned,
            **ended,
        ):
            return None
    request_settled(
        request=request,
        completion_tokens=completion_tokens,
        cost_ucents=cost,
        finish_reason=finish_reason,
        result=result,
    )
    split = billing.hold_settle(
        hold=request.hold,
        cost_ucents=cost,
        host=host,
        host_ucents=earned if host is not None else None,
        others=paid,
        reference=request.public_id,
        memo="" if ring is None else ring_memo(ring),
        escrow=escrow,
    )
    if split is None:
        return None
    if ring is not None:
        assert job is not None  # a ring is looked up only for a job's host
        StageShare.objects.bulk_create(
            StageShare(
                job_id=job.pk,
                host_id=host_id,
                plan=ring[0],
                layers=ring[1][host_id],
                n_layers=ring[0].n_layers,
                earned_ucents=amount,
                finished_at=now,
            )
            for host_id, amount in paid.items()
        )
    return Settlement(cost_ucents=cost, earned_ucents=split.host_ucents, platform_ucents=split.platform_ucents)
