"""Stored responses (`store: true` on /v1/responses): kept for `RESPONSE_STORE_SECONDS`, read
only with a key of the account that stored them (a key that is not account-wide reads only its
own), then deleted by the watchdog's sweep.

Whatever is not stored for this reader — another account's, expired, never stored, failed, or
no such id — is the same 404: an id never tells a stranger that it exists.

What is kept is bounded, and decided before anything is queued or billed (`stored_turn_admit`):
the conversation as normalised items only (`responses.stored_items`: a key of no meaning is not
kept, so it is not carried to the next turn either), at most `RESPONSE_STORE_MAX_BYTES` of it
and of the fields the Response repeats, and at most `RESPONSE_STORE_ACCOUNT_MAX_BYTES` for all
of an account's live stored responses together; over either is a 400 naming the limit. The
answer itself adds what `max_output_tokens` allows, and counts at the next turn. The save, once
the request is billed, holds nothing the database could refuse (`storable`).
"""

from __future__ import annotations

import json
from datetime import timedelta

from django.conf import settings
from django.db.models import QuerySet, Sum
from django.utils import timezone

from accounts.models import ApiKey
from accounts.selectors import key_from_secret, key_scope
from core.db import db
from core.errors import ApiError
from core.http import holds_nul
from marketplace.models import StoredResponse
from marketplace.openai import responses


def json_bytes(value: object) -> int:
    """The size a stored value is counted at: its compact JSON, in UTF-8 bytes."""
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass"))


def storable(value: object) -> object:
    """`value` with nothing the database refuses: no NUL character (PostgreSQL's text and
    jsonb hold none) and no lone surrogate (not UTF-8), in any string or key. Admission
    refuses both in what it validates; this holds for whatever else reaches a save after the
    request was billed (a host's text, a field echoed as sent)."""
    if isinstance(value, str):
        if "\x00" in value:
            value = value.replace("\x00", "")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            value = value.encode("utf-8", "replace").decode("utf-8")
        return value
    if isinstance(value, dict):
        return {storable(key): storable(item) for key, item in value.items()}
    if isinstance(value, list):
        return [storable(item) for item in value]
    return value


async def stored_turn_admit(*, secret: str, body: dict) -> list[dict] | None:
    """For a /v1/responses body (continued already): None when its response is not to be kept
    (no `store: true`: nothing to check); else the normalised items it will keep before its
    answer, once within the limits. The key first (a 401), then the body's own 400s, then a
    400 when what it keeps is over `RESPONSE_STORE_MAX_BYTES` or would take the account past
    `RESPONSE_STORE_ACCOUNT_MAX_BYTES`, or holds a NUL character. Runs before admission: a
    refusal here has queued and billed nothing."""
    if body.get("store") in (None, False):
        return None
    return await db(_stored_turn_check, secret=secret, body=body)


def _stored_turn_check(*, secret: str, body: dict) -> list[dict] | None:
    key = key_from_secret(secret)
    data = responses.validated(body)
    if not data.get("store"):
        return None
    kept, echo = responses.stored_items(data["input"]), responses.echoed(body)
    for name, value in echo.items():
        if holds_nul(value):
            raise ApiError(
                400,
                f"'{name}' holds a NUL character, which a stored response cannot keep.",
                code="invalid_value",
                param=name,
            )
    size = json_bytes(kept) + json_bytes(echo)
    limit = settings.RESPONSE_STORE_MAX_BYTES
    if size > limit:
        raise ApiError(
            400,
            f"This response would be stored with {size} bytes of conversation and fields, over the limit of "
            f"{limit} bytes for one stored response. Send it with store: false, or continue a shorter "
            "conversation.",
            code="stored_response_too_large",
            param="input",
        )
    used = _account_bytes(key)
    room = settings.RESPONSE_STORE_ACCOUNT_MAX_BYTES
    if used + size > room:
        raise ApiError(
            400,
            f"Your account's stored responses hold {used} bytes; this one would add {size}, over the account's "
            f"limit of {room} bytes. Delete some (DELETE /v1/responses/{{id}}), let them expire "
            f"({settings.RESPONSE_STORE_SECONDS} seconds after each was stored), or send store: false.",
            code="response_store_full",
            param="store",
        )
    return kept


def _account_bytes(key: ApiKey) -> int:
    """What the key's account keeps in live stored responses, in `json_bytes`."""
    rows = StoredResponse.objects.filter(request__user=key.user, expires_at__gt=timezone.now())
    return rows.aggregate(total=Sum("size_bytes"))["total"] or 0


def stored_response_save(*, request_id: int, kept: list[dict], response: dict) -> StoredResponse:
    """Keep a whole answer (`response`, the Response object returned) and the conversation a
    later turn continues (`kept`, from `stored_turn_admit`, then the answer's output), until
    `RESPONSE_STORE_SECONDS` from now. Called once the request was billed: nothing in it can
    be refused (`storable`)."""
    conversation, body = storable(responses.conversation_after(kept, response)), storable(response)
    expires_at = timezone.now() + timedelta(seconds=settings.RESPONSE_STORE_SECONDS)
    return StoredResponse.objects.create(
        request_id=request_id,
        conversation=conversation,
        body=body,
        expires_at=expires_at,
        size_bytes=json_bytes(conversation) + json_bytes(body),
    )


def stored_responses_expire() -> int:
    """Delete every stored response past its time (deleted, not hidden). Returns how many."""
    deleted, _ = StoredResponse.objects.filter(expires_at__lte=timezone.now()).delete()
    return deleted


def _readable(key: ApiKey, response_id: str) -> QuerySet[StoredResponse]:
    if holds_nul(response_id):  # names nothing (and the database cannot compare with it)
        return StoredResponse.objects.none()
    rows = StoredResponse.objects.filter(
        request__public_id=response_id, request__user=key.user, expires_at__gt=timezone.now()
    )
    scope = key_scope(key)
    return rows.filter(request__api_key=scope) if scope is not None else rows


def stored_conversation(*, secret: str, response_id: object) -> list[dict]:
    """The conversation `previous_response_id` continues: its items, then its output. The key
    first (a 401), then the id as the body gave it: a 400 when it is not a string (validation
    would take a number as its digits), a 404 naming it when this key reads no such response."""
    key = key_from_secret(secret)
    if not isinstance(response_id, str):
        raise ApiError(
            400,
            "'previous_response_id' must be a string: the id of a stored response (resp_…).",
            code="invalid_value",
            param="previous_response_id",
        )
    row = _readable(key, response_id).only("conversation").first()
    if row is None:
        raise ApiError(
            404,
            f"Previous response with id {response_id[:100]!r} not found (responses are stored only with "
            f"store: true, for {settings.RESPONSE_STORE_SECONDS} seconds, and read by the key's account).",
            code="previous_response_not_found",
            param="previous_response_id",
        )
    return row.conversation


def _not_stored(response_id: str) -> ApiError:
    return ApiError(
        404,
        f"No stored response with id {response_id[:100]!r} for this key (responses are stored only with "
        f"store: true, for {settings.RESPONSE_STORE_SECONDS} seconds).",
        code="not_found",
        param="id",
    )


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
