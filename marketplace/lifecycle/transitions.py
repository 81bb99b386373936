"""A request's two ends: settled (billed, its prompt deleted) and failed (unbilled, its
hold released, its prompt deleted). Both are compare-and-sets on the request row and tell
its listeners after the commit; the money of a settlement is `settlement`'s.
"""

from __future__ import annotations

from django.utils import timezone

from billing import services as billing
from billing.models import Hold
from core.events import announce_on_commit, request_group
from marketplace.models import Request


def request_settled(
    *, request: Request, completion_tokens: int, cost_ucents: int, finish_reason: str, result: list | None = None
) -> None:
    Request.objects.filter(pk=request.pk).update(
        status=Request.Status.COMPLETED,
        finished_at=timezone.now(),
        completion_tokens=completion_tokens,
        cost_ucents=cost_ucents,
        finish_reason=finish_reason,
        messages=None,
        prompt=None,
        prefix_hashes=None,
        inputs=None,
        result=result,
    )
    announce_on_commit(request_group(request.public_id), {"type": "request.ended"})


def request_fail(*, request: Request, code: str, message: str) -> bool:
    """End a request unbilled: release its hold and delete its prompt."""
    ended = Request.objects.filter(pk=request.pk, status__in=[Request.Status.QUEUED, Request.Status.RUNNING]).update(
        status=Request.Status.FAILED,
        finished_at=timezone.now(),
        error_code=code,
        error_message=message[:500],
        messages=None,
        prompt=None,
        prefix_hashes=None,
        inputs=None,
    )
    if not ended:
        return False
    billing.hold_release(hold=Hold.objects.get(pk=request.hold_id))
    announce_on_commit(request_group(request.public_id), {"type": "request.ended"})
    return True
