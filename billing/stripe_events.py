"""Stripe's webhook: a delivery verified over its raw bytes, recorded once, and applied
(`billing.topups` for payments, refunds and disputes; `billing.payout_accounts` for Connect)."""

from __future__ import annotations

import stripe
from django.db import IntegrityError, transaction

from billing import stripe_api
from billing.errors import InvalidWebhook
from billing.models import StripeEvent, TopUp
from billing.payout_accounts import payout_account_updated
from billing.topups import topup_credit, topup_dispute, topup_refund

CREDITING_EVENTS = ("checkout.session.completed", "checkout.session.async_payment_succeeded")


def stripe_webhook_receive(*, payload: bytes, signature: str) -> StripeEvent:
    """Verify a delivery over its raw bytes, then apply it (idempotently).

    Raises InvalidWebhook for a forged, stale, re-serialised or malformed body.
    """
    if not stripe_api.topups_configured():
        raise InvalidWebhook("Stripe webhooks are not configured on this gateway.")
    try:
        event = stripe_api.webhook_event(payload=payload, signature=signature)
    except (ValueError, stripe.SignatureVerificationError) as error:
        raise InvalidWebhook(f"Webhook rejected: {error}") from None
    obj = event.data.object.to_dict() if event.data and event.data.object else None
    return stripe_event_apply(event_id=event.id, event_type=event.type, obj=obj)


@transaction.atomic
def stripe_event_apply(*, event_id: str, event_type: str, obj: dict | None) -> StripeEvent:
    """Record a verified event once and apply it, in one transaction: a paid checkout
    session credits its top-up; a refund or a dispute of that payment takes the credit
    back (`topup_refund`, `topup_dispute`); a dispute won gives it back; Connect's
    `account.updated` marks a payout account ready once its onboarding finished.

    The event row is inserted first: a concurrent delivery of the same event
    blocks on the unique id and then finds it, so a replay applies nothing.
    The top-up row lock plus its status compare-and-set (and the ledger's unique
    reference, the session id) make two *different* events for one session
    credit it once; refunds and disputes count what was already taken back.
    """
    try:
        with transaction.atomic():
            record = StripeEvent.objects.create(event_id=event_id, type=event_type, outcome=StripeEvent.Outcome.IGNORED)
    except IntegrityError:
        return StripeEvent.objects.get(event_id=event_id)
    applied: tuple[str, TopUp | None, str] | None = None
    if obj is None:
        pass
    elif event_type in CREDITING_EVENTS and obj.get("payment_status") == "paid":
        applied = topup_credit(session=obj)
    elif event_type == "charge.refunded":
        applied = topup_refund(charge=obj)
    elif event_type in ("charge.dispute.created", "charge.dispute.closed"):
        applied = topup_dispute(dispute=obj, closed=event_type == "charge.dispute.closed")
    elif event_type == "account.updated":
        applied = payout_account_updated(account=obj)
    if applied is not None:
        outcome, topup, detail = applied
        StripeEvent.objects.filter(pk=record.pk).update(outcome=outcome, topup=topup, detail=detail[:500])
        record.refresh_from_db()
    return record
