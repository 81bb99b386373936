"""Celery interface to the marketplace's periodic work."""

from __future__ import annotations

from celery import shared_task

from marketplace import services
from marketplace.lifecycle import canaries
from marketplace.openai import stored_responses
from marketplace.trust import prefixes, ring_inquiries
from marketplace.trust.audit_scoring import audit_score_pending


@shared_task(name="marketplace.tasks.watchdog_tick", ignore_result=True)
def watchdog_tick() -> int:
    """Expire unclaimed requests, fail stalled jobs, forget delivered output and delete stored
    responses and prompt prefix records past their time."""
    return services.watchdog_tick() + stored_responses.stored_responses_expire() + prefixes.prefixes_expire()


@shared_task(name="marketplace.tasks.canary_scoring", ignore_result=True)
def canary_scoring() -> int:
    """Score canary answers that parted from their reference at a near-tie."""
    return canaries.canary_score_pending()


@shared_task(name="marketplace.tasks.audit_scoring", ignore_result=True)
def audit_scoring() -> int:
    """Re-read audited answers under the real model and pay or refund; move ring inquiries on."""
    return audit_score_pending() + ring_inquiries.inquiries_watch()
