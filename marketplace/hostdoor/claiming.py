"""A host's claim long-poll: the one behind both doors, `POST /hosts/api/claim` and a
`claim` frame on the host's WebSocket.

The long-poll answers with a job's payload as soon as one is queued for a model the host
qualified on its machine, or None after `wait` seconds. A canary that is due for the host
is queued here, so it arrives the way customers' jobs do (not with a heartbeat, which would
mark it). A trusted host with no customer's job to take may get an audit to score instead
(`marketplace.trust.audits.audit_claim_payload`, kind "audit"). It holds one of the host's claim
slots while it waits (`marketplace.hostdoor.claim_slots`), and sleeps on the channel layer until a
job is queued or offered, rather than polling the database.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from channels.layers import get_channel_layer
from django.conf import settings
from django.utils import timezone
from rest_framework import serializers

from core.db import db
from core.errors import ApiError
from core.events import Inbox, host_group, queue_group
from hosts import selectors as hosts
from hosts.models import Host, connected_since
from marketplace import services as market
from marketplace.hostdoor.claim_slots import WAITING
from marketplace.lifecycle import canaries
from marketplace.trust.audits import audit_claim_payload
from marketplace.trust.ring_inquiries import inquiry_claim_payload
from mesh.rings.selectors import bridged_model_ids
from protocol.timing import CLAIM_WAIT_SECONDS

BOOT_PATTERN = r"^[A-Za-z0-9_-]*$"


def boot_field() -> serializers.RegexField:
    """A mahout process's boot id, as its heartbeat and its claims carry it (optional: older
    clients send none)."""
    return serializers.RegexField(
        BOOT_PATTERN,
        max_length=64,
        required=False,
        default="",
        allow_blank=True,
        help_text="the claiming process's boot id, drawn at random when it starts",
    )


class JobClaimInputSerializer(serializers.Serializer):
    """A claim's input, at either door (`JobClaimApi.InputSerializer`, a claim frame)."""

    fingerprint = serializers.CharField(max_length=64)
    wait = serializers.FloatField(min_value=0, max_value=settings.CLAIM_MAX_WAIT_SECONDS, default=CLAIM_WAIT_SECONDS)
    boot = boot_field()


async def claim_when_offered(host: Host, *, fingerprint: str, wait: float, boot: str = "") -> Mapping[str, Any] | None:
    """A job's payload as soon as one is queued for a model this host qualified on this
    machine, or None after `wait` seconds. `boot` (the claiming process's boot id, seen by
    the door first: `services.host_boot_seen`) is kept on the job it claims. Refusals (paused, in
    maintenance, no heartbeat within HOST_OFFLINE_AFTER_SECONDS, a mahout older than MAHOUT_MIN_VERSION,
    nothing qualified, every claim slot waiting already) are DomainErrors."""
    if host.paused:
        raise ApiError(
            403, "This host is paused; resume it to claim work.", code="host_paused", type="permission_error"
        )
    if host.maintenance_since is not None:
        raise ApiError(
            403,
            f"This host is in maintenance: {host.maintenance_reason} Its owner or an operator can resume it.",
            code="host_maintenance",
            type="permission_error",
        )
    if host.last_heartbeat_at is None or host.last_heartbeat_at < connected_since(timezone.now()):
        raise ApiError(  # a host that does not say it is there gets no work
            409,
            f"This host has not sent a heartbeat in the last {settings.HOST_OFFLINE_AFTER_SECONDS} seconds; "
            "send one (POST /hosts/api/heartbeat, as mahout does every few seconds) before claiming work.",
            code="heartbeat_required",
            type="invalid_request_error",
        )
    too_old = hosts.client_too_old(host.version)
    if too_old is not None:
        raise ApiError(
            426, f"{too_old}; upgrade it before claiming work.", code="upgrade_required", type="invalid_request_error"
        )
    model_ids = await db(hosts.qualified_model_ids, host=host, fingerprint=fingerprint)
    if not model_ids:
        raise ApiError(
            403,
            "This host has not qualified any model on this machine; run the benchmark and register it first.",
            code="not_qualified",
            type="permission_error",
        )
    await db(canaries.canary_send_if_due, host=host)  # verification needs no customer traffic
    cap = host.claim_cap
    ticket = await WAITING.enter(host.pk, cap=cap, wait=wait)
    if ticket is None:
        raise ApiError(
            429,
            f"This host already has {cap} claims waiting; it may run at most {cap} jobs at once "
            f"({host.slots} slots, {host.standing}). Wait for one to return before claiming again.",
            code="too_many_claims",
            type="rate_limit_error",
        )
    try:
        return await _claim_when_woken(host, model_ids=model_ids, wait=wait, boot=boot)
    finally:
        await WAITING.leave(host.pk, ticket)


async def _claim_when_woken(host: Host, *, model_ids: list[int], wait: float, boot: str) -> Mapping[str, Any] | None:
    warm_ids = await db(hosts.warm_model_ids, host=host, model_ids=model_ids)
    ring_ids = await db(bridged_model_ids, host_id=host.pk)
    layer = get_channel_layer()
    channel = await layer.new_channel()
    groups = [queue_group(model_id) for model_id in model_ids] + [host_group(host.pk)]
    for group in groups:
        await layer.group_add(group, channel)
    inbox = Inbox(layer, channel)
    try:
        return await _claim_until(host, wait, model_ids, warm_ids, ring_ids, inbox, boot)
    finally:
        inbox.close()
        for group in groups:
            await layer.group_discard(group, channel)


async def _claim_until(
    host: Host,
    wait: float,
    model_ids: list[int],
    warm_ids: list[int],
    ring_ids: list[int],
    inbox: Inbox,
    boot: str,
) -> Mapping[str, Any] | None:
    """Claim, or sleep until woken. Offers to other hosts and the cold grace lapse
    without a wake-up, so a waiting host also looks again every ROUTING_OFFER_SECONDS.
    A model it serves through a ring (`ring_ids`) gets no audit to score: a ring's bridge
    holds no llama.cpp model to read one with."""
    scorable = [model_id for model_id in model_ids if model_id not in ring_ids]
    deadline = time.monotonic() + wait
    recheck = max(settings.ROUTING_OFFER_SECONDS, 0.2)
    look = True
    payload: Mapping[str, Any] | None
    while True:  # a host paused while it waits simply gets nothing
        if look:
            payload = await db(market.job_claim_payload, host=host, model_ids=model_ids, warm_ids=warm_ids, boot=boot)
            if payload is None and host.trusted_at is not None:  # no customer waits on it: an audit to score, if any
                payload = await db(audit_claim_payload, host=host, model_ids=scorable, boot=boot)
                if payload is None:  # or a ring's failed audit to look into
                    payload = await db(inquiry_claim_payload, host=host, model_ids=scorable, boot=boot)
            if payload is not None:
                return payload
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        message = await inbox.next(min(remaining, recheck))
        look = message is None or _first_to_hear(message)


_HEARD_OFFERS: OrderedDict[str, None] = OrderedDict()  # jobs offered to a host, that one of its waiters here took up
_HEARD_KEPT = 10_000


def _first_to_hear(message: dict) -> bool:
    """An offer to a host wakes all of its long-polls in this process (a host with 25 slots
    has 25); one of them claims, the others keep waiting, instead of 25 claims racing for
    one job. Other wake-ups (a job any host may take) wake everyone, as before. A missed
    offer is still found by the next recheck."""
    offer = message.get("offer")
    if not isinstance(offer, str):
        return True
    if offer in _HEARD_OFFERS:
        return False
    _HEARD_OFFERS[offer] = None
    if len(_HEARD_OFFERS) > _HEARD_KEPT:
        _HEARD_OFFERS.popitem(last=False)
    return True
