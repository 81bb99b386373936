"""The two Stripe calls we make, behind one small client.

Every call has a timeout, bounded retries, and an idempotency key, so a retry
(ours or the SDK's) can never create a second session or a second transfer.
`STRIPE_API_BASE` points the client elsewhere (tests run a local server that
speaks Stripe's wire format).
"""
from __future__ import annotations

from functools import lru_cache

import stripe
from django.conf import settings


def topups_configured() -> bool:
    return bool(settings.STRIPE_SECRET_KEY and settings.STRIPE_WEBHOOK_SECRET)


def payouts_configured() -> bool:
    return bool(settings.STRIPE_SECRET_KEY)


@lru_cache(maxsize=4)
def _client(secret_key: str, api_base: str, timeout: float, retries: int) -> stripe.StripeClient:
    return stripe.StripeClient(
        secret_key,
        base_addresses={"api": api_base} if api_base else None,
        max_network_retries=retries,
        http_client=stripe.RequestsClient(timeout=timeout),
    )


def client() -> stripe.StripeClient:
    return _client(
        settings.STRIPE_SECRET_KEY, settings.STRIPE_API_BASE, settings.STRIPE_TIMEOUT_SECONDS, settings.STRIPE_MAX_RETRIES
    )


def checkout_session_create(*, topup_id: int, amount_cents: int, currency: str, email: str) -> stripe.checkout.Session:
    """A one-off Checkout Session for `amount_cents`; `client_reference_id` is our TopUp id."""
    params: dict = {
        "mode": "payment",
        "client_reference_id": str(topup_id),
        "metadata": {"topup_id": str(topup_id)},
        "line_items": [
            {
                "quantity": 1,
                "price_data": {
                    "currency": currency,
                    "unit_amount": amount_cents,
                    "product_data": {"name": "Elephant inference credit"},
                },
            }
        ],
        "success_url": settings.TOPUP_SUCCESS_URL,
        "cancel_url": settings.TOPUP_CANCEL_URL,
    }
    if email:
        params["customer_email"] = email
    return client().v1.checkout.sessions.create(params, {"idempotency_key": f"topup-{topup_id}"})


def transfer_create(*, payout_id: int, amount_cents: int, currency: str, destination: str) -> stripe.Transfer:
    """Send a payout to a connected account. The idempotency key is the payout id
    (prefixed so it can never collide with a top-up's key on the same account)."""
    return client().v1.transfers.create(
        {
            "amount": amount_cents,
            "currency": currency,
            "destination": destination,
            "metadata": {"payout_id": str(payout_id)},
        },
        {"idempotency_key": f"payout-{payout_id}"},
    )


def webhook_event(*, payload: bytes, signature: str) -> stripe.Event:
    """Verify Stripe's signature over the exact bytes received, within the tolerance.

    Raises ValueError (not JSON / not UTF-8) or stripe.SignatureVerificationError.
    """
    return stripe.Webhook.construct_event(
        payload.decode("utf-8"), signature, settings.STRIPE_WEBHOOK_SECRET, tolerance=settings.STRIPE_WEBHOOK_TOLERANCE_SECONDS
    )
