"""The customer's side of a running request: listening, leaving (a dropped stream may come
back within the grace; after it the request is abandoned and what was delivered settles),
withdrawing a sibling choice, and forgetting the delivered text once it was handed over.
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from hosts.models import Host
from marketplace.lifecycle.answers import CUSTOMER_TEXT_PARAMS, answer_of, completion_tokens_counted
from marketplace.lifecycle.errors import Cancelled
from marketplace.lifecycle.settlement import rescuer_share, settle
from marketplace.lifecycle.transitions import request_fail
from marketplace.models import Job, Request, TextChunk


def request_listener_left(*, request_id: int) -> bool:
    """The customer's connection to a request that is still running went away (the stream
    dropped, or a client waiting for the whole answer hung up). Unless one re-attaches
    within ABANDON_GRACE_SECONDS (a dropped stream resumes), the request is abandoned."""
    return bool(
        Request.objects.filter(pk=request_id, status__in=[Request.Status.QUEUED, Request.Status.RUNNING]).update(
            left_at=timezone.now()
        )
    )


def request_listener_here(*, request_id: int) -> bool:
    """A customer is listening again (a re-attach, or another open stream of the request)."""
    return bool(Request.objects.filter(pk=request_id, left_at__isnull=False).update(left_at=None))


def request_withdraw(*, request_id: int) -> str:
    """End a request now as if abandoned long ago (a sibling choice of `n` was refused at
    admission): queued, it ends unbilled. Returns what request_abandon returns."""
    Request.objects.filter(pk=request_id, status__in=[Request.Status.QUEUED, Request.Status.RUNNING]).update(
        left_at=timezone.now() - timedelta(seconds=settings.ABANDON_GRACE_SECONDS + 1)
    )
    return request_abandon(request_id=request_id)


@transaction.atomic
def request_abandon(*, request_id: int) -> str:
    """Nobody has listened to this request for ABANDON_GRACE_SECONDS: stop paying for it.

    A queued job is withdrawn and the request ends unbilled. A running job ends now: its
    host's next batch is refused (it stops), the tokens delivered so far are billed and its
    host is paid for them as for any answer, and the request ends with finish_reason
    "cancelled". Nothing is a strike against the host. Returns "cancelled", "settled", or ""
    (it ended meanwhile, or someone re-attached)."""
    cutoff = timezone.now() - timedelta(seconds=settings.ABANDON_GRACE_SECONDS)
    request = (
        Request.objects.select_for_update()
        .select_related("model", "hold")
        .filter(pk=request_id, status__in=[Request.Status.QUEUED, Request.Status.RUNNING], left_at__lt=cutoff)
        .first()
    )
    if request is None:
        return ""
    job = Job.objects.filter(request=request, status__in=[Job.Status.QUEUED, Job.Status.RUNNING]).first()
    running = job is not None and job.status == Job.Status.RUNNING and request.kind != Request.Kind.EMBEDDINGS
    answer = answer_of(request, request.delivered_text)[0] if running else ""  # (a queued job delivered nothing)
    tokens = (
        min(completion_tokens_counted(request, answer), int(request.params.get("max_tokens") or 0)) if answer else 0
    )
    if job is None or job.status == Job.Status.QUEUED or tokens == 0:
        if job is not None:
            Job.objects.filter(pk=job.pk, status__in=[Job.Status.QUEUED, Job.Status.RUNNING]).update(
                status=Job.Status.FAILED,
                finished_at=timezone.now(),
                fail_reason="the customer went away",
                fail_cause="request",
            )
        request_fail(
            request=request, code=Cancelled.code, message="The customer went away before any text; nothing was billed."
        )
        return "cancelled"
    share = rescuer_share(request=request, job=job, text=answer, completion_tokens=tokens)
    assert job.host_id is not None  # a running job has its host (the claimed_job_has_host constraint)
    if (
        settle(
            request=request,
            completion_tokens=tokens,
            finish_reason="cancelled",
            job=job,
            host=Host.objects.get(pk=job.host_id),
            share=share,
            note="the customer went away: the answer so far was settled",
        )
        is None
    ):
        return ""
    return "settled"


def request_forget_output(*, request_id: int) -> bool:
    """Delete the delivered text (or vectors) of an ended request once it has been handed
    over, and with it the customer's stop strings (the last text of theirs a request
    keeps: they cut that text when it is re-read, so they live exactly as long)."""
    with transaction.atomic():
        row = (
            Request.objects.select_for_update()
            .filter(pk=request_id, status__in=[Request.Status.COMPLETED, Request.Status.FAILED], output_forgotten=False)
            .values("params")
            .first()
        )
        if row is None:
            return False
        params = {name: value for name, value in (row["params"] or {}).items() if name not in CUSTOMER_TEXT_PARAMS}
        Request.objects.filter(pk=request_id).update(result=None, output_forgotten=True, params=params)
        TextChunk.objects.filter(request_id=request_id).delete()
    return True
