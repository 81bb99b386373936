"""What every door reads from a request: the bearer secret, the JSON body, an id in the path.

HTTP views pass the `HttpRequest`; WebSocket consumers pass their ASGI scope. A
missing or malformed value is a `DomainError` in the API's own format.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.conf import settings
from django.http import HttpRequest
from django.urls import register_converter
from rest_framework.request import Request

from core.errors import ApiError, bad_request
from core.parsers import NotFinite, TooDeep, json_loads

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
            401,
            "Missing API key: send it as 'Authorization: Bearer <key>'.",
            code="missing_api_key",
            type="authentication_error",
        )
    return secret


def json_body(request: HttpRequest) -> dict:
    length = int(request.headers.get("Content-Length") or 0)
    if length > settings.DATA_UPLOAD_MAX_MEMORY_SIZE:
        raise ApiError(
            413,
            f"Request body too large ({length} bytes; the limit is {settings.DATA_UPLOAD_MAX_MEMORY_SIZE}).",
            code="body_too_large",
        )
    try:
        body = json_loads(request.body or b"")
    except NotFinite as exc:
        raise bad_request(
            f"The body holds {exc}, which is not JSON: numbers must be finite.", code="invalid_json"
        ) from None
    except TooDeep as exc:
        raise bad_request(f"The body is refused: its {exc}.", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError):
        raise bad_request("The body is not valid JSON.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The body must be a JSON object.", code="invalid_json")
    return body


def holds_nul(value: object) -> bool:
    """Whether a value read from JSON or a URL holds a NUL character (in a string or a key).
    PostgreSQL's text and jsonb cannot store one, nor compare with one: such input is
    refused (or names nothing) rather than failing in the database."""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(holds_nul(key) or holds_nul(item) for key, item in value.items())
    if isinstance(value, list):
        return any(holds_nul(item) for item in value)
    return False


# The largest values the database's integer columns hold (PostgreSQL's integer and bigint):
# a number from a request bound for one is refused past these with a 400, not a 500.
INT_MAX = 2**31 - 1
BIGINT_MAX = 2**63 - 1


class IdConverter:
    """`<id:job_id>`: a row's id in a path. Django's `int` takes any number of digits, and a
    number past 64 bits overflows the query (a 500); such a number names no row, so the path
    does not match: a 404, like any other id that names nothing."""

    regex = "[0-9]{1,18}"
    limit = 10**18 - 1  # the largest id the path takes (documented in the schema: config/settings.py)

    def to_python(self, value: str) -> int:
        return int(value)

    def to_url(self, value: int) -> str:
        return str(value)


register_converter(IdConverter, "id")  # once, on import: every URL configuration with an id imports its views first
