"""Top-ups through Stripe Checkout: the session is created here, the credit comes only from
Stripe's signed events (`billing.stripe_events`), and so do refunds and chargebacks, which
take it back."""

from __future__ import annotations

from typing import TYPE_CHECKING

import stripe
from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from billing import stripe_api
from billing.errors import InvalidAmount, PaymentProviderError, TopupsNotConfigured
from billing.ledger import account_for_customer, ledger_post, system_account
from billing.models import Account, LedgerTransaction, StripeEvent, TopUp
from catalog.money import UCENTS_PER_CENT, usd

if TYPE_CHECKING:
    from django.contrib.auth.models import User


def topup_create(*, user: User, amount_cents: int, success_url: str, cancel_url: str) -> TopUp:
    """Create a Checkout Session for `amount_cents` and return our TopUp (with its URL).
    Stripe sends the customer back to `success_url` or `cancel_url` (the caller's own
    address: the gateway as the customer reached it).

    Not one transaction on purpose: the row commits before Stripe is called (its
    id is the idempotency key and the session's client_reference_id), so no
    session can exist that we do not know about. Nothing is credited here.
    """
    if not stripe_api.topups_configured():
        raise TopupsNotConfigured("Top-ups are not configured on this gateway; ask an operator to grant credit.")
    low, high = settings.TOPUP_MIN_CENTS, settings.TOPUP_MAX_CENTS
    if not low <= amount_cents <= high:
        raise InvalidAmount(topup_rule())
    topup = TopUp.objects.create(user=user, amount_cents=amount_cents, currency=settings.BILLING_CURRENCY)
    try:
        session = stripe_api.checkout_session_create(
            topup_id=topup.pk,
            amount_cents=amount_cents,
            currency=topup.currency,
            email=user.email,
            success_url=success_url,
            cancel_url=cancel_url,
        )
    except stripe.StripeError as error:
        TopUp.objects.filter(pk=topup.pk, status=TopUp.Status.CREATING).update(status=TopUp.Status.FAILED)
        raise PaymentProviderError(
            f"The payment provider refused to start a checkout: {error.user_message or error}"
        ) from None
    TopUp.objects.filter(pk=topup.pk, status=TopUp.Status.CREATING).update(
        status=TopUp.Status.OPEN, stripe_session_id=session.id, checkout_url=session.url or ""
    )
    topup.refresh_from_db()
    return topup


def topup_rule() -> str:
    """The one sentence that states the top-up limits (the form and the API say it too)."""
    return (
        f"Top-ups are between {usd(settings.TOPUP_MIN_CENTS * UCENTS_PER_CENT)} "
        f"and {usd(settings.TOPUP_MAX_CENTS * UCENTS_PER_CENT)}."
    )


def _paid_topup(payment_intent: object) -> TopUp | None:
    """The paid top-up of a payment, locked (refunds and disputes name the payment)."""
    if not isinstance(payment_intent, str) or not payment_intent:
        return None
    return (
        TopUp.objects.select_for_update().filter(stripe_payment_intent=payment_intent, status=TopUp.Status.PAID).first()
    )


def _take_back(*, topup: TopUp, cents: int, kind: str, reference: str, memo: str) -> None:
    """Debit the customer (through the ledger) what Stripe gave back to the card: the balance
    may go negative, and admission then refuses with 402 until it is covered."""
    ledger_post(
        kind=kind,
        reference=reference,
        memo=memo[:255],
        legs=[  # the customer's account first, the global lock order
            (account_for_customer(user=topup.user), -cents * UCENTS_PER_CENT),
            (system_account(Account.Kind.FUNDING), cents * UCENTS_PER_CENT),
        ],
    )


def topup_refund(*, charge: dict) -> tuple[str, TopUp | None, str]:
    """A refund of a top-up's payment (Stripe's `amount_refunded` is cumulative): take back
    what was refunded and not yet taken back, never more than the top-up less its disputes."""
    topup = _paid_topup(charge.get("payment_intent"))
    if topup is None:
        return StripeEvent.Outcome.REJECTED, None, f"no paid top-up for payment {charge.get('payment_intent')}"
    refunded = charge.get("amount_refunded")
    if not isinstance(refunded, int) or refunded < 0:
        return StripeEvent.Outcome.REJECTED, topup, f"amount_refunded {refunded!r} is not a number of cents"
    new = min(refunded, topup.amount_cents - topup.disputed_cents) - topup.refunded_cents
    if new <= 0:
        return StripeEvent.Outcome.IGNORED, topup, f"{topup.refunded_cents} cents already taken back for refunds"
    _take_back(
        topup=topup,
        cents=new,
        kind=LedgerTransaction.Kind.REFUND,
        reference=f"refund-{charge.get('id')}-{refunded}",
        memo=f"Stripe refund of top-up {topup.pk}: {new / 100:.2f} {topup.currency.upper()}",
    )
    TopUp.objects.filter(pk=topup.pk).update(refunded_cents=topup.refunded_cents + new)
    return StripeEvent.Outcome.DEBITED, topup, f"refunded {new} cents"


def topup_dispute(*, dispute: dict, closed: bool) -> tuple[str, TopUp | None, str]:
    """A chargeback: opened, the disputed amount is taken back at once (Stripe takes it from
    us then); closed and won, it is given back; closed and lost, it stays taken."""
    topup = _paid_topup(dispute.get("payment_intent"))
    if topup is None:
        return StripeEvent.Outcome.REJECTED, None, f"no paid top-up for payment {dispute.get('payment_intent')}"
    opened = LedgerTransaction.objects.filter(
        kind=LedgerTransaction.Kind.CHARGEBACK, reference=f"dispute-{dispute.get('id')}"
    ).first()
    taken = (
        -sum(opened.entries.filter(account__kind=Account.Kind.CUSTOMER).values_list("amount_ucents", flat=True))
        // UCENTS_PER_CENT
        if opened
        else 0
    )
    if not closed:
        if opened is not None:
            return StripeEvent.Outcome.IGNORED, topup, f"dispute {dispute.get('id')} already taken back"
        amount = dispute.get("amount")
        if not isinstance(amount, int) or amount <= 0:
            return StripeEvent.Outcome.REJECTED, topup, f"dispute amount {amount!r} is not a number of cents"
        cents = min(amount, topup.amount_cents - topup.refunded_cents - topup.disputed_cents)
        if cents <= 0:
            return StripeEvent.Outcome.IGNORED, topup, "nothing of this top-up is left to take back"
        _take_back(
            topup=topup,
            cents=cents,
            kind=LedgerTransaction.Kind.CHARGEBACK,
            reference=f"dispute-{dispute.get('id')}",
            memo=f"Stripe dispute of top-up {topup.pk} ({dispute.get('reason') or 'no reason given'})",
        )
        TopUp.objects.filter(pk=topup.pk).update(disputed_cents=topup.disputed_cents + cents)
        return StripeEvent.Outcome.DEBITED, topup, f"disputed {cents} cents"
    if dispute.get("status") != "won" or taken <= 0:
        return StripeEvent.Outcome.IGNORED, topup, f"dispute {dispute.get('id')} closed {dispute.get('status')}"
    try:
        with transaction.atomic():
            ledger_post(
                kind=LedgerTransaction.Kind.CHARGEBACK_WON,
                reference=f"dispute-won-{dispute.get('id')}",
                memo=f"Stripe dispute of top-up {topup.pk} won",
                legs=[
                    (account_for_customer(user=topup.user), taken * UCENTS_PER_CENT),
                    (system_account(Account.Kind.FUNDING), -taken * UCENTS_PER_CENT),
                ],
            )
    except IntegrityError:  # (the ledger's unique reference: a second "won" for the same dispute)
        return StripeEvent.Outcome.IGNORED, topup, f"dispute {dispute.get('id')} already given back"
    TopUp.objects.filter(pk=topup.pk).update(disputed_cents=max(0, topup.disputed_cents - taken))
    return StripeEvent.Outcome.RESTORED, topup, f"dispute won: {taken} cents given back"


def topup_credit(*, session: dict) -> tuple[str, TopUp | None, str]:
    """Credit the TopUp a paid session belongs to, if it is ours and the amount matches.

    A session we never stored (Stripe created it, but its answer to us was lost: the
    top-up is still `creating`, or `failed` when the call timed out) is found by its
    `client_reference_id`, our top-up's id, and reconciled here: the signed event is
    Stripe's own account of the session."""
    topup = TopUp.objects.select_for_update().filter(stripe_session_id=session.get("id")).first()
    reference = session.get("client_reference_id")
    if topup is None and isinstance(reference, str) and reference.isdigit():
        topup = (
            TopUp.objects.select_for_update()
            .filter(
                pk=int(reference),
                stripe_session_id__isnull=True,
                status__in=[TopUp.Status.CREATING, TopUp.Status.FAILED],
            )
            .first()
        )
        if topup is not None:
            TopUp.objects.filter(pk=topup.pk).update(stripe_session_id=session.get("id"), status=TopUp.Status.OPEN)
            topup.refresh_from_db()
    if topup is None:
        return StripeEvent.Outcome.REJECTED, None, f"no top-up for session {session.get('id')}"
    paid = (session.get("amount_total"), (session.get("currency") or "").lower(), session.get("client_reference_id"))
    expected = (topup.amount_cents, topup.currency, str(topup.pk))
    if paid != expected:
        return StripeEvent.Outcome.REJECTED, topup, f"session says {paid}, we created {expected}"
    if topup.status != TopUp.Status.OPEN:
        return StripeEvent.Outcome.IGNORED, topup, f"top-up already {topup.status}"
    assert topup.stripe_session_id is not None  # found by the session's id, or given it above
    txn = ledger_post(
        kind=LedgerTransaction.Kind.TOPUP,
        reference=topup.stripe_session_id,
        memo=f"Stripe Checkout top-up {topup.pk}",
        legs=[
            (system_account(Account.Kind.FUNDING), -topup.amount_ucents),
            (account_for_customer(user=topup.user), topup.amount_ucents),
        ],
    )
    TopUp.objects.filter(pk=topup.pk, status=TopUp.Status.OPEN).update(
        status=TopUp.Status.PAID,
        transaction=txn,
        paid_at=timezone.now(),
        stripe_payment_intent=session.get("payment_intent") if isinstance(session.get("payment_intent"), str) else "",
    )
    return StripeEvent.Outcome.CREDITED, topup, ""
