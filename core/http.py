"""What every door reads from a request: the bearer secret and the JSON body.

HTTP views pass the `HttpRequest`; WebSocket consumers pass their ASGI scope. A
missing or malformed value is a `DomainError` in the API's own format.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

from django.conf import settings
from django.http import HttpRequest
from rest_framework.request import Request

from core.errors import ApiError, bad_request

if TYPE_CHECKING:
    from django.contrib.auth.models import User


class AuthedHttpRequest(HttpRequest):
    """For the type checker only: the request of a view behind `login_required`, whose user is signed in."""

    user: User


def bearer_of(authorization: str) -> str | None:
    """The secret of an `Authorization: Bearer <secret>` header value, or None."""
    scheme, _, secret = authorization.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        return None
    return secret.strip()


def scope_bearer(scope: dict) -> str | None:
    """The bearer secret of a WebSocket's (or any ASGI) scope, or None."""
    for name, value in scope.get("headers", []):
        if name.decode().lower() == "authorization":
            return bearer_of(value.decode())
    return None


def bearer_secret(request: HttpRequest | Request) -> str:
    secret = bearer_of(request.headers.get("Authorization", ""))
    if secret is None:
        raise ApiError(
            401, "Missing API key: send it as 'Authorization: Bearer <key>'.", code="missing_api_key", type="authentication_error"
        )
    return secret


class NotFinite(ValueError):
    """NaN or ±Infinity: Python's JSON reader takes them, JSON does not, and a runner breaks on them."""


def reject_non_finite(constant: str) -> object:
    raise NotFinite(constant)


def json_body(request: HttpRequest) -> dict:
    length = int(request.headers.get("Content-Length") or 0)
    if length > settings.DATA_UPLOAD_MAX_MEMORY_SIZE:
        raise ApiError(413, f"Request body too large ({length} bytes; the limit is {settings.DATA_UPLOAD_MAX_MEMORY_SIZE}).", code="body_too_large")
    try:
        body = json.loads(request.body or b"", parse_constant=reject_non_finite)
    except NotFinite as exc:
        raise bad_request(f"The body holds {exc}, which is not JSON: numbers must be finite.", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError):
        raise bad_request("The body is not valid JSON.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The body must be a JSON object.", code="invalid_json")
    return body
