"""When an attempt dies: it is fenced first (anything it still sends is refused), then put
back in the queue if it delivered nothing, continued once on another host from exactly the
delivered text if it did, settled if the answer was already whole, or failed honestly and
unbilled. Deaths come from the host (`job_fail`), its dropped connection, a ban, or the
watchdog's liveness rules.
"""

from __future__ import annotations

from datetime import datetime

from django.db import transaction
from django.utils import timezone

from billing import services as billing
from core.events import announce_on_commit, request_group
from hosts.models import Host
from hosts.services import host_ban
from marketplace.lifecycle import settlement
from marketplace.lifecycle.answers import answer_of, completion_tokens_counted, finish_reason_checked
from marketplace.lifecycle.claims import locked_job_of
from marketplace.lifecycle.errors import CompletionRefused, HostFailed, JobNotRunning, RequestNotRunnable
from marketplace.lifecycle.queueing import job_queue
from marketplace.lifecycle.settlement import Completion, settle_without_host
from marketplace.lifecycle.transitions import request_fail
from marketplace.models import Job, Request
from marketplace.trust.audits import audit_scorer_restarted
from marketplace.trust.reputation import host_rest_if_unreliable
from marketplace.trust.ring_inquiries import host_blame

MAX_ATTEMPTS = 2  # the first attempt, and once per request a continuation (never requeued)


MAX_REQUEUES = 3  # deaths before any text that put the first attempt back in the queue


@transaction.atomic
def job_fail(*, host: Host, job_id: int, reason: str, cause: str = "host") -> str:
    """The host gave up on a job: continue it elsewhere once, else fail honestly (`cause`:
    see `attempt_end_dead`)."""
    locked_job_of(host=host, job_id=job_id)
    return attempt_end_dead(job_id=job_id, reason=reason, cause=cause)


def job_complete(
    *,
    host: Host,
    job_id: int,
    finish_reason: str,
    embeddings: list | None = None,
    token_ids: list[int] | None = None,
) -> Completion:
    """A host's completion (`settlement.job_complete`). One that is no evidence of its answer
    (`marketplace.lifecycle.evidence`) ends the attempt as the host's failure, as if it had
    given the job up: requeued before its first token, continued after it, nothing paid; one
    no honest draw could be also puts its host in maintenance with the evidence. The host is
    told why (`CompletionRefused`)."""
    try:
        return settlement.job_complete(
            host=host, job_id=job_id, finish_reason=finish_reason, embeddings=embeddings, token_ids=token_ids
        )
    except CompletionRefused as refused:
        if refused.proven:  # (first: the attempt may have ended meanwhile, the evidence stands)
            host_blame(host=host, why=f"Failed verification at completion: {refused.message}"[:500])
        try:
            job_fail(host=host, job_id=job_id, reason=refused.message[:500], cause="host")
        except JobNotRunning:  # the watchdog or a ban ended it while its evidence was read
            pass
        raise


# Our words, not a host's: a host's own failure text (kept in Job.fail_reason for operators)
# is never quoted to the customer.
NOT_RUNNABLE = (
    "Two hosts could not run this request as sent; nothing was billed. Check what it asks for "
    "(the prompt's length against the model's context, response_format, tools, the sampling parameters) "
    "and send it again."
)


@transaction.atomic
def attempt_end_dead(*, job_id: int, reason: str, cause: str = "host") -> str:
    """Fence a dead attempt and decide what happens to its request.

    The attempt is marked failed first (compare-and-set), so anything it still
    sends is refused. Then seed 001's rule, "one continuation, then an honest error":

    - Nothing of the request reached the customer yet (its first attempt died before
      its first token): the same attempt is put back in the queue, silently — no
      `resumed`, the continuation unspent, the dead host skipped for the grace — at
      most MAX_REQUEUES times. One more such death fails the request honestly
      (`host_failed`, unbilled, not resumed): a continuation of nothing would resume
      nothing, and yet another host would only hide a sick pool.
    - Text reached the customer: the request's one continuation is queued, resuming
      from exactly the delivered text, preferring another host.
    - The continuation's host dies, before or after its first token: the request
      fails honestly and unbilled. A continuation is never requeued, so one request
      meets at most MAX_REQUEUES + 2 hosts.

    Before any of these, an answer the delivered text already ended settles as complete
    (`_settled_if_whole`). Returns "requeued", "continued", "settled", "failed", or ""
    when the attempt had already ended (someone else got there first).

    `cause` "request": the host says the job's own content cannot be run. That is no
    strike against it; the request gets a second opinion from another host (the same
    rules as a death), and fails honestly ("request_not_runnable", unbilled) when a
    second host says so too. A host that blames a request another host then serves is
    counted as having failed (`blame_corrected`, at completion).
    """
    if not Job.objects.filter(pk=job_id, status=Job.Status.RUNNING).update(
        status=Job.Status.FAILED, finished_at=timezone.now(), fail_reason=reason[:500], fail_cause=cause
    ):
        return ""
    job = Job.objects.get(pk=job_id)
    assert job.host_id is not None  # it was running, so it has its host (the claimed_job_has_host constraint)
    if cause != "request":
        host_rest_if_unreliable(host_id=job.host_id)
    request = Request.objects.select_for_update().select_related("model", "hold").get(pk=job.request_id)
    if request.status != Request.Status.RUNNING:
        return ""
    if (
        cause == "request"
        and Job.objects.filter(request_id=request.pk, fail_cause="request").exclude(host_id=job.host_id).exists()
    ):
        request_fail(request=request, code=RequestNotRunnable.code, message=NOT_RUNNABLE)
        return "failed"
    from marketplace.lifecycle.canaries import canary_void, is_canary  # (canaries queue through this module)

    if is_canary(request):  # a canary tests one host: it is never handed to another
        if cause == "request":  # its content is known to run: blaming it is the host's own failure (no free void)
            Job.objects.filter(pk=job.pk).update(fail_cause="host")
            host_rest_if_unreliable(host_id=job.host_id)
        request_fail(request=request, code=HostFailed.code, message="The host did not answer this canary.")
        canary_void(request=request)
        return "failed"
    if _settled_if_whole(request=request, job=job):
        return "settled"
    if job.attempt == 1 and job.generated_chars == 0:  # nothing of this request reached the customer
        return _requeue_or_fail(request=request, job=job)
    if job.attempt >= MAX_ATTEMPTS:
        request_fail(
            request=request,
            code=HostFailed.code,
            message="The host serving this request failed, and so did the host that took over; nothing was billed.",
        )
        return "failed"
    Request.objects.filter(pk=request.pk).update(resumed=True)
    job_queue(
        request=request,
        model=request.model,
        attempt=job.attempt + 1,
        avoid_host_id=job.host_id,
        trusted_only=job.trusted_only,
    )
    announce_on_commit(request_group(request.public_id), {"type": "job.resumed"})
    return "continued"


def _settled_if_whole(*, request: Request, job: Job) -> bool:
    """Settle the request if the delivered text already ended the answer: a stop sequence of
    the customer's is in it, it used the whole output budget, or the host's last batch said
    its generation ended (EOS or its max_tokens: `Job.text_end`) before it died unreported.
    A continuation would add nothing, so the answer settles as complete: billed for the
    delivered text as the gateway counts it (the prompt once), not resumed, and no host
    paid (seed 001: a payout needs a completed job)."""
    if request.kind == Request.Kind.EMBEDDINGS or (request.delivered_chars == 0 and not job.text_end):
        return False
    answer, stopped = answer_of(request, request.delivered_text)
    tokens, max_tokens = (
        (completion_tokens_counted(request, answer) if answer else 0),
        int(request.params["max_tokens"]),
    )
    if not (stopped or tokens >= max_tokens or job.text_end):
        return False
    reason = (
        "stop"
        if stopped
        else finish_reason_checked(claimed=job.text_end or "length", completion_tokens=tokens, max_tokens=max_tokens)
    )
    settle_without_host(request=request, completion_tokens=tokens, finish_reason=reason)
    return True


def _requeue_or_fail(*, request: Request, job: Job) -> str:
    """A first attempt that delivered nothing: back in the queue while requeues are left."""
    if job.requeue < MAX_REQUEUES:
        job_queue(
            request=request,
            model=request.model,
            attempt=job.attempt,
            requeue=job.requeue + 1,
            avoid_host_id=job.host_id,
            trusted_only=job.trusted_only,
        )
        return "requeued"
    request_fail(
        request=request,
        code=HostFailed.code,
        message=f"{MAX_REQUEUES + 1} hosts in a row failed before writing "
        "anything for this request; nothing was billed.",
    )
    return "failed"


def host_connection_lost(*, host_id: int, opened_at: datetime | None = None) -> int:
    """The host's presence connection dropped (a killed process closes its sockets): every
    attempt it was running is dead. Returns how many. With `opened_at` (when the dropped
    socket opened), a host that has opened a newer socket since is back, and nothing dies:
    the drop was the network's or a gateway process's fault, not the host's."""
    if opened_at is not None and Host.objects.filter(pk=host_id, socket_since__gt=opened_at).exists():
        return 0
    running = list(Job.objects.filter(host_id=host_id, status=Job.Status.RUNNING).values_list("pk", flat=True))
    return sum(1 for job_id in running if attempt_end_dead(job_id=job_id, reason="the host's connection dropped"))


def host_boot_seen(*, host_id: int, boot: str) -> int:
    """The host spoke with boot id `boot` (its heartbeat, its claim, its socket's hello;
    mahout draws one at random each time its process starts). Its running attempts claimed
    under another boot id belong to a process that no longer runs (one mahout process per
    host token, as for its socket): they are dead now, continued or requeued as for any
    death, and no longer fill the host's claim cap while the stall rule would wait them
    out; an audit it was scoring goes to another scorer (`audits.audit_scorer_restarted`).
    Without a boot id (an older client) nothing happens, and attempts claimed without
    one are never ended this way. Returns how many ended (attempts and audits)."""
    if not boot:
        return 0
    stale = list(
        Job.objects.filter(host_id=host_id, status=Job.Status.RUNNING)
        .exclude(boot__in=("", boot))
        .values_list("pk", flat=True)
    )
    ended = sum(1 for job_id in stale if attempt_end_dead(job_id=job_id, reason="its host restarted"))
    return ended + audit_scorer_restarted(host_id=host_id, boot=boot)


@transaction.atomic
def host_ban_with_consequences(*, host: Host, reason: str, by: str) -> bool:
    """An operator's ban (`hosts.services.host_ban`: refused everywhere, token revoked), and
    what follows from it here: its running jobs are ended now and continued elsewhere, and
    its earnings that have not vested are forfeited to the platform with the reason."""
    if not host_ban(host=host, reason=reason, by=by):
        return False
    running = list(Job.objects.filter(host_id=host.pk, status=Job.Status.RUNNING).values_list("pk", flat=True))
    for job_id in running:
        attempt_end_dead(job_id=job_id, reason="its host was banned")
    billing.earnings_forfeit(host=host, reason=f"Banned by {by}: {reason}")
    return True
