"""Stored responses (`store: true` on /v1/responses): kept for `RESPONSE_STORE_SECONDS`, read
only with a key of the account that stored them (a key that is not account-wide reads only its
own), then deleted by the watchdog's sweep.

Whatever is not stored for this reader — another account's, expired, never stored, failed, or
no such id — is the same 404: an id never tells a stranger that it exists.
"""
from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db.models import QuerySet
from django.utils import timezone

from accounts.models import ApiKey
from accounts.selectors import key_from_secret, key_scope
from core.errors import ApiError
from core.http import holds_nul
from marketplace.models import StoredResponse


def stored_response_save(*, request_id: int, conversation: list[dict], body: dict) -> StoredResponse:
    """Keep a whole answer (`body`, the Response object returned) and the conversation a later
    turn continues, until `RESPONSE_STORE_SECONDS` from now."""
    expires_at = timezone.now() + timedelta(seconds=settings.RESPONSE_STORE_SECONDS)
    return StoredResponse.objects.create(request_id=request_id, conversation=conversation, body=body, expires_at=expires_at)


def stored_responses_expire() -> int:
    """Delete every stored response past its time (deleted, not hidden). Returns how many."""
    deleted, _ = StoredResponse.objects.filter(expires_at__lte=timezone.now()).delete()
    return deleted


def _readable(key: ApiKey, response_id: str) -> QuerySet[StoredResponse]:
    if holds_nul(response_id):  # names nothing (and the database cannot compare with it)
        return StoredResponse.objects.none()
    rows = StoredResponse.objects.filter(request__public_id=response_id, request__user=key.user,
                                         expires_at__gt=timezone.now())
    scope = key_scope(key)
    return rows.filter(request__api_key=scope) if scope is not None else rows


def stored_conversation(*, secret: str, response_id: object) -> list[dict]:
    """The conversation `previous_response_id` continues: its items, then its output. The key
    first (a 401), then the id as the body gave it: a 400 when it is not a string (validation
    would take a number as its digits), a 404 naming it when this key reads no such response."""
    key = key_from_secret(secret)
    if not isinstance(response_id, str):
        raise ApiError(400, "'previous_response_id' must be a string: the id of a stored response (resp_…).",
                       code="invalid_value", param="previous_response_id")
    row = _readable(key, response_id).only("conversation").first()
    if row is None:
        raise ApiError(404, f"Previous response with id {response_id[:100]!r} not found (responses are stored only with "
                       f"store: true, for {settings.RESPONSE_STORE_SECONDS} seconds, and read by the key's account).",
                       code="previous_response_not_found", param="previous_response_id")
    return row.conversation


def _not_stored(response_id: str) -> ApiError:
    return ApiError(404, f"No stored response with id {response_id[:100]!r} for this key (responses are stored only with "
                    f"store: true, for {settings.RESPONSE_STORE_SECONDS} seconds).", code="not_found", param="id")


def stored_response_body(*, key: ApiKey, response_id: str) -> dict:
    """The Response object as it was returned, or a 404."""
    row = _readable(key, response_id).only("body").first()
    if row is None:
        raise _not_stored(response_id)
    return row.body


def stored_response_delete(*, key: ApiKey, response_id: str) -> None:
    """Delete it now (its request's row, the bill, stays); a 404 when there is none to delete."""
    deleted, _ = _readable(key, response_id).delete()
    if not deleted:
        raise _not_stored(response_id)

