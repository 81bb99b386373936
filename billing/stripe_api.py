"""The Stripe calls we make, behind one small client.

Every call has a timeout and bounded retries, and every create an idempotency key, so
a retry (ours or the SDK's) can never create a second session, transfer or account.
`STRIPE_API_BASE` points the client elsewhere: local test mode's stand-in
(`billing/stripe_local.py`, which `make run` starts when no real key is set) or a
test's.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

import stripe
from django.conf import settings

if TYPE_CHECKING:
    from stripe.params import AccountCreateParams
    from stripe.params.checkout import SessionCreateParams


def topups_configured() -> bool:
    return bool(settings.STRIPE_SECRET_KEY and settings.STRIPE_WEBHOOK_SECRET)


def payouts_configured() -> bool:
    return bool(settings.STRIPE_SECRET_KEY)


def mode() -> str:
    """ "local" when the client talks to a stand-in (STRIPE_API_BASE), "test" with Stripe's own
    test keys, "live" with live keys, "" when Stripe is not configured: every page says which
    unless it is live."""
    if not settings.STRIPE_SECRET_KEY:
        return ""
    if settings.STRIPE_API_BASE:
        return "local"
    return "test" if settings.STRIPE_SECRET_KEY.startswith(("sk_test_", "rk_test_")) else "live"


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
        settings.STRIPE_SECRET_KEY,
        settings.STRIPE_API_BASE,
        settings.STRIPE_TIMEOUT_SECONDS,
        settings.STRIPE_MAX_RETRIES,
    )


def checkout_session_create(
    *, topup_id: int, amount_cents: int, currency: str, email: str, success_url: str, cancel_url: str
) -> stripe.checkout.Session:
    """A one-off Checkout Session for `amount_cents`; `client_reference_id` is our TopUp id.
    Stripe sends the customer's browser back to `success_url` or `cancel_url`."""
    params: SessionCreateParams = {
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
        "success_url": success_url,
        "cancel_url": cancel_url,
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


def connected_account_create(*, host_id: int, email: str, attempt: str) -> stripe.Account:
    """An Express connected account for a machine's payouts (transfers requested). `attempt`
    names this creation in the idempotency key: a repeated click reuses the account."""
    params: AccountCreateParams = {
        "type": "express",
        "capabilities": {"transfers": {"requested": True}},
        "metadata": {"host_id": str(host_id)},
    }
    if email:
        params["email"] = email
    return client().v1.accounts.create(params, {"idempotency_key": f"payout-account-{host_id}-{attempt}"})


def connected_account_retrieve(account_id: str) -> stripe.Account:
    return client().v1.accounts.retrieve(account_id)


def account_link_create(*, account_id: str, return_url: str, refresh_url: str) -> stripe.AccountLink:
    """A one-time onboarding link (it expires within minutes): Stripe sends the owner to
    `return_url` when they leave it, to `refresh_url` when the link is stale."""
    return client().v1.account_links.create(
        {"account": account_id, "type": "account_onboarding", "return_url": return_url, "refresh_url": refresh_url}
    )


def account_ready(fields: dict) -> bool:
    """Onboarding finished and the account can receive our transfers (`fields`: the account as
    Stripe describes it, retrieved or carried by `account.updated`)."""
    return bool(fields.get("details_submitted")) and (fields.get("capabilities") or {}).get("transfers") == "active"


def webhook_event(*, payload: bytes, signature: str) -> stripe.Event:
    """Verify Stripe's signature over the exact bytes received, within the tolerance.

    Raises ValueError (not JSON / not UTF-8) or stripe.SignatureVerificationError.
    """
    return stripe.Webhook.construct_event(
        payload.decode("utf-8"),
        signature,
        settings.STRIPE_WEBHOOK_SECRET,
        tolerance=settings.STRIPE_WEBHOOK_TOLERANCE_SECONDS,
    )
