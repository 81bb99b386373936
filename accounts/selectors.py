"""Reads of API keys, and the customer API's authentication."""

from __future__ import annotations

from typing import TYPE_CHECKING

from accounts.key_use import api_key_used
from accounts.models import ApiKey
from core.errors import ApiError
from core.secrets import secret_hash

if TYPE_CHECKING:
    from django.contrib.auth.models import User


def api_key_by_secret(*, secret: str) -> ApiKey | None:
    """The live key for a secret, or None (unknown or revoked), with its user and the user's
    pending e-mail verification if any (`key_unverified`), in one query (a LEFT JOIN: an
    EXISTS annotation cost twice as much, BENCHMARKS.md)."""
    key = ApiKey.objects.select_related("user", "user__email_verification").filter(key_hash=secret_hash(secret)).first()
    if key is None or key.revoked_at is not None or not key.user.is_active:
        return None
    return key


def key_unverified(key: ApiKey) -> bool:
    """Whether the key's account signed up and has not confirmed its address yet."""
    verification = getattr(key.user, "email_verification", None)  # (None: no row, an operator-made account)
    return verification is not None and verification.verified_at is None


def key_for_spending(secret: str) -> ApiKey:
    """`key_from_secret`, and a 403 while its account's e-mail address is not confirmed
    (a key made before then, e.g. by someone who signed up with another's address, cannot
    spend the credit its real owner adds)."""
    key = key_from_secret(secret)
    if key_unverified(key):
        raise ApiError(
            403,
            f"Confirm this account's e-mail address first: open the link we sent to {key.user.email} "
            "(signing up again with it sends a new one).",
            code="email_unverified",
            type="permission_error",
        )
    return key


def key_from_secret(secret: str) -> ApiKey:
    """The live key for a bearer secret, or a 401 in the API's format. Every /v1 call with a
    key comes through here, so this is where its "last used" is recorded (coalesced to one
    write a minute: `accounts.key_use.api_key_used`)."""
    key = api_key_by_secret(secret=secret)
    if key is None:
        raise ApiError(401, "Invalid or revoked API key.", code="invalid_api_key", type="authentication_error")
    api_key_used(key=key)
    return key


def account_unconfirmed(user: User) -> bool:
    """Whether `user` signed up and has not confirmed its e-mail address yet: such an account
    makes no API key and registers no machine."""
    from accounts.models import EmailVerification

    return EmailVerification.objects.filter(user=user, verified_at__isnull=True).exists()


def key_scope(key: ApiKey) -> ApiKey | None:
    """Whose requests a key reads: None for an account-wide key (all of its account's), else
    the key itself (only its own)."""
    return None if key.account_wide else key
