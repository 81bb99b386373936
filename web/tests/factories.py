"""Rows the pages read, made the way the request path makes them (a hold, then the request and its job)."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from django.db import transaction
from django.utils import timezone

from billing import services as billing
from marketplace.models import CanaryCheck, CanaryReference, Job, Request

if TYPE_CHECKING:
    from hosts.models import Host
    from testkit.personas import Customer


@transaction.atomic  # as the request path does (a hold locks its account)
def finished_request(
    *,
    customer: Customer,
    host: Host | None = None,
    cost_ucents: int = 1_000,
    resumed: bool = False,
    failed: bool = False,
) -> Request:
    """A request admitted with `customer`'s key and settled for `cost_ucents` (host earns 80%), or failed."""
    from catalog.models import CatalogModel

    model = CatalogModel.objects.get(name="gemma-3-270m")
    hold = billing.hold_place(user=customer.user, api_key=customer.key, amount_ucents=max(cost_ucents, 1))
    request = Request.objects.create(
        public_id=f"chatcmpl-{uuid.uuid4().hex[:24]}",
        user=customer.user,
        api_key=customer.key,
        model=model,
        kind=Request.Kind.CHAT,
        params={"max_tokens": 16},
        hold=hold,
        prompt_tokens=7,
        completion_tokens=5,
        resumed=resumed,
        status=Request.Status.FAILED if failed else Request.Status.COMPLETED,
        finished_at=timezone.now(),
    )
    if failed:
        billing.hold_release(hold=hold)
        Job.objects.create(request=request, model=model, status=Job.Status.FAILED, finished_at=timezone.now())
        return request
    if host is None:  # a completed job always has a host; this one is nobody the test looks at
        from conftest import make_host

        host = make_host(qualified=False, name=f"rig-{uuid.uuid4().hex[:6]}").host
    split = billing.hold_settle(hold=hold, cost_ucents=cost_ucents, host=host, reference=request.public_id)
    Request.objects.filter(pk=request.pk).update(cost_ucents=cost_ucents)
    Job.objects.create(
        request=request,
        model=model,
        host=host,
        status=Job.Status.COMPLETED,
        completion_tokens=5,
        earned_ucents=split.host_ucents,
        finished_at=timezone.now(),
        claimed_at=timezone.now(),
    )
    request.refresh_from_db()
    return request


def canary_checked(*, host: Host, verdict: str, reason: str = "") -> CanaryCheck:
    """A canary `host` answered and the gateway judged (`verdict`), paid like any request."""
    from catalog.models import CatalogModel
    from conftest import make_customer

    model = CatalogModel.objects.get(name="gemma-3-270m")
    reference = CanaryReference.objects.create(
        model=model,
        kind="completion",
        prompt="The capital of France is",
        max_tokens=8,
        text=" Paris.",
        tokens=2,
        exact_chars=7,
    )
    request = finished_request(customer=make_customer(), host=host)
    return CanaryCheck.objects.create(
        host=host,
        reference=reference,
        request=request,
        verdict=verdict,
        reason=reason if verdict == "failed" else "",
        decided_at=timezone.now(),
    )
