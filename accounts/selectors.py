"""Reads of API keys, and the customer API's authentication."""
from __future__ import annotations

from django.db.models import Exists, OuterRef

from accounts.models import ApiKey, EmailVerification
from core.errors import ApiError
from core.secrets import secret_hash


def api_key_by_secret(*, secret: str) -> ApiKey | None:
    """The live key for a secret, or None (unknown or revoked); `unverified` is annotated
    (its account's e-mail address is not confirmed yet), in the same query."""
    key = (
        ApiKey.objects.select_related("user").filter(key_hash=secret_hash(secret))
        .annotate(unverified=Exists(EmailVerification.objects.filter(user=OuterRef("user"), verified_at__isnull=True)))
        .first()
    )
    if key is None or key.revoked_at is not None or not key.user.is_active:
        return None
    return key


def key_for_spending(secret: str) -> ApiKey:
    """`key_from_secret`, and a 403 while its account's e-mail address is not confirmed
    (a key made before then, e.g. by someone who signed up with another's address, cannot
    spend the credit its real owner adds)."""
    key = key_from_secret(secret)
    if getattr(key, "unverified", False):
        raise ApiError(
            403, f"Confirm this account's e-mail address first: open the link we sent to {key.user.email} "
            "(signing up again with it sends a new one).", code="email_unverified", type="permission_error",
        )
    return key


def key_from_secret(secret: str) -> ApiKey:
    """The live key for a bearer secret, or a 401 in the API's format."""
    key = api_key_by_secret(secret=secret)
    if key is None:
        raise ApiError(401, "Invalid or revoked API key.", code="invalid_api_key", type="authentication_error")
    return key
