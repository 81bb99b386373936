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
from marketplace.lifecycle.answers import answer_of, completion_tokens_counted
from marketplace.lifecycle.claims import locked_job_of
from marketplace.lifecycle.errors import HostFailed, RequestNotRunnable
from marketplace.lifecycle.queueing import job_queue
from marketplace.lifecycle.settlement import settle_without_host
from marketplace.lifecycle.transitions import request_fail
from marketplace.models import Job, Request
from marketplace.reputation import host_rest_if_unreliable

MAX_ATTEMPTS = 2  # the first host, and once per request another one that continues


MAX_REQUEUES = 3  # deaths before the first token that put an attempt back in the queue


@transaction.atomic
def job_fail(*, host: Host, job_id: int, reason: str, cause: str = "host") -> str:
    """The host gave up on a job: continue it elsewhere once, else fail honestly (`cause`:
    see `attempt_end_dead`)."""
    locked_job_of(host=host, job_id=job_id)
    return attempt_end_dead(job_id=job_id, reason=reason, cause=cause)


# Our words, not a host's: a host's own failure text (kept in Job.fail_reason for operators)
# is never quoted to the customer.
NOT_RUNNABLE = ("Two hosts could not run this request as sent; nothing was billed. Check what it asks for "
                "(the prompt's length against the model's context, response_format, tools, the sampling parameters) "
                "and send it again.")


@transaction.atomic
def attempt_end_dead(*, job_id: int, reason: str, cause: str = "host") -> str:
    """Fence a dead attempt and decide what happens to its request.

    The attempt is marked failed first (compare-and-set), so anything it still
    sends is refused. An attempt that died before its first token is simply put
    back in the queue (seed 001): the same attempt again, silently — no `resumed`,
    the request's one continuation still unspent, the dead host skipped for the
    grace — at most MAX_REQUEUES times, and the queue timeout still ends it
    honestly. After the first token, once per request, a continuation job is queued
    that resumes from exactly the delivered text, preferring another host; a second
    death fails the request unbilled. Returns "requeued", "continued", "settled"
    (the output budget was already used up), "failed", or "" when the attempt had
    already ended (someone else got there first).

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
    if cause != "request":
        host_rest_if_unreliable(host_id=job.host_id)
    request = Request.objects.select_for_update().select_related("model", "hold").get(pk=job.request_id)
    if request.status != Request.Status.RUNNING:
        return ""
    if cause == "request" and Job.objects.filter(request_id=request.pk, fail_cause="request").exclude(host_id=job.host_id).exists():
        request_fail(request=request, code=RequestNotRunnable.code, message=NOT_RUNNABLE)
        return "failed"
    from marketplace.canaries import canary_void, is_canary  # (canaries queue through this module)

    if is_canary(request):  # a canary tests one host: it is never handed to another
        if cause == "request":  # its content is known to run: blaming it is the host's own failure (no free void)
            Job.objects.filter(pk=job.pk).update(fail_cause="host")
            host_rest_if_unreliable(host_id=job.host_id)
        request_fail(request=request, code=HostFailed.code, message="The host did not answer this canary.")
        canary_void(request=request)
        return "failed"
    if job.generated_chars == 0 and job.requeue < MAX_REQUEUES:  # nothing of this attempt reached the customer
        job_queue(request=request, model=request.model, attempt=job.attempt, requeue=job.requeue + 1, avoid_host_id=job.host_id,
                  trusted_only=job.trusted_only)
        return "requeued"
    if job.attempt >= MAX_ATTEMPTS:
        request_fail(
            request=request, code=HostFailed.code,
            message="The host serving this request failed, and so did the host that took over; nothing was billed.",
        )
        return "failed"
    answer, stopped = ("", False) if request.kind == Request.Kind.EMBEDDINGS else answer_of(request, request.delivered_text)
    delivered_tokens = completion_tokens_counted(request, answer) if answer else 0
    if request.kind != Request.Kind.EMBEDDINGS and (stopped or delivered_tokens >= int(request.params["max_tokens"])):
        settle_without_host(request=request, completion_tokens=delivered_tokens, finish_reason="stop" if stopped else "length")
        return "settled"
    Request.objects.filter(pk=request.pk).update(resumed=True)
    job_queue(request=request, model=request.model, attempt=job.attempt + 1, avoid_host_id=job.host_id, trusted_only=job.trusted_only)
    announce_on_commit(request_group(request.public_id), {"type": "job.resumed"})
    return "continued"


def host_connection_lost(*, host_id: int, opened_at: datetime | None = None) -> int:
    """The host's presence connection dropped (a killed process closes its sockets): every
    attempt it was running is dead. Returns how many. With `opened_at` (when the dropped
    socket opened), a host that has opened a newer socket since is back, and nothing dies:
    the drop was the network's or a gateway process's fault, not the host's."""
    if opened_at is not None and Host.objects.filter(pk=host_id, socket_since__gt=opened_at).exists():
        return 0
    running = list(Job.objects.filter(host_id=host_id, status=Job.Status.RUNNING).values_list("pk", flat=True))
    return sum(1 for job_id in running if attempt_end_dead(job_id=job_id, reason="the host's connection dropped"))


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
