"""Billing refusals. Each is a `DomainError` carrying its OpenAI-style `code` and its
HTTP `status`, rendered by core's one mapping."""

from __future__ import annotations

from core.errors import DomainError


class BillingError(DomainError):
    code = "billing_error"
    status = 402


class InsufficientCredit(BillingError):
    code = "insufficient_credit"


class KeyLimitExceeded(BillingError):
    code = "key_limit_exceeded"


class RateLimited(BillingError):
    """The key admitted `rate_limit_per_minute` requests in the last 60 s."""

    code = "rate_limited"
    status = 429
    retry_after = (
        60  # the most it can be (a rolling minute); the refusal says exactly when the oldest admission leaves it
    )


class TooManyStreams(BillingError):
    """The key already has `max_concurrent` requests in flight."""

    code = "too_many_streams"
    status = 429
    retry_after = 1  # a slot frees when any of the key's requests ends


class TopupsNotConfigured(BillingError):
    code = "topups_not_configured"
    status = 503


class PayoutsNotConfigured(BillingError):
    code = "payouts_not_configured"
    status = 503


class InvalidAmount(BillingError):
    code = "invalid_amount"
    status = 400


class PaymentProviderError(BillingError):
    """Stripe refused or could not be reached; nothing was charged or credited."""

    code = "payment_provider_error"
    status = 502


class PayoutRefused(BillingError):
    code = "payout_refused"
    status = 409


class InvalidWebhook(BillingError):
    """Bad signature, stale timestamp, or a body that is not the one Stripe signed."""

    code = "invalid_webhook"
    status = 400
