"""Reads of API keys, and the customer API's authentication."""
from __future__ import annotations

from accounts.models import ApiKey
from core.errors import ApiError
from core.secrets import secret_hash


def api_key_by_secret(*, secret: str) -> ApiKey | None:
    """The live key for a secret, or None (unknown or revoked)."""
    key = ApiKey.objects.select_related("user").filter(key_hash=secret_hash(secret)).first()
    if key is None or key.revoked_at is not None or not key.user.is_active:
        return None
    return key


def key_from_secret(secret: str) -> ApiKey:
    """The live key for a bearer secret, or a 401 in the API's format."""
    key = api_key_by_secret(secret=secret)
    if key is None:
        raise ApiError(401, "Invalid or revoked API key.", code="invalid_api_key", type="authentication_error")
    return key
