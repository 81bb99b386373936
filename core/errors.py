"""Domain errors and their one mapping to HTTP, in OpenAI's format:
{"error": {"message", "type", "param", "code"}}.

Every refusal a caller can act on is a `DomainError`: a subclass names its HTTP
`status` and its `code` as class attributes (`InsufficientCredit`, `JobNotRunning`),
or an instance names them (`DomainError("…", status=404, code="model_not_found")`).
Services raise them without knowing about HTTP; the three doors (DRF views, async
views, WebSockets) render them here, by data, never by a list of classes: `response()`
for HTTP (with `Retry-After` and any other headers), `frame()` for a socket's error
frame, `ws_close_code` for a socket refused at its handshake.
"""

from __future__ import annotations

from django.http import HttpResponse, JsonResponse
from rest_framework import exceptions
from rest_framework.views import exception_handler

# OpenAI's `type` for each status; a subclass or an instance may name its own.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "insufficient_quota",
    403: "permission_error",
    404: "invalid_request_error",
    409: "conflict",
    413: "invalid_request_error",
    429: "rate_limit_error",
    502: "api_error",
    503: "api_error",
}

# WebSocket close codes for refusals at connect time (4000 + the HTTP status).
WS_CLOSE_OFFSET = 4000


class DomainError(Exception):
    """An error a caller can act on; rendered with its status and code."""

    status = 400
    code = "invalid_request"
    type = ""
    param: str | None = None

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str | None = None,
        type: str | None = None,  # noqa: A002
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code
        self.type = type or self.type or ERROR_TYPES.get(self.status, "api_error")
        if param is not None:
            self.param = param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    retry_after: int | None = None  # seconds after which trying again can succeed (429, 503, 504)
    headers: dict[str, str] | None = None  # more for the client to read (the rate-limit headers of a 429)

    def response(self) -> JsonResponse:
        response = JsonResponse(self.body(), status=self.status)
        if self.retry_after is not None:
            response["Retry-After"] = str(self.retry_after)
        for name, value in (self.headers or {}).items():
            response[name] = value
        return response

    def frame(self, **extra: object) -> dict:
        """The error as a WebSocket frame, `extra` naming what it answers (a claim's `id`, a
        batch's `job` and `seq`): `{"type": "error", **extra, "status", "code", "message"}`."""
        return {"type": "error", **extra, "status": self.status, "code": self.code, "message": self.message}

    @property
    def ws_close_code(self) -> int:
        return WS_CLOSE_OFFSET + self.status


class ApiError(DomainError):
    """A refusal decided at the door (bad auth, an unknown id), status first."""

    type = "invalid_request_error"

    def __init__(
        self, status: int, message: str, *, code: str, type: str | None = None, param: str | None = None
    ) -> None:  # noqa: A002
        super().__init__(message, status=status, code=code, type=type, param=param)


def bad_request(message: str, *, code: str = "invalid_request", param: str | None = None) -> DomainError:
    return DomainError(message, status=400, code=code, param=param)


def _first_error(errors: object, path: list[str | int]) -> tuple[list[str | int], str]:
    """Walk DRF's nested error structure to the first message and its field path."""
    if isinstance(errors, dict):
        for key, value in errors.items():
            if value:
                return _first_error(value, path if key == "non_field_errors" else [*path, key])
    if isinstance(errors, list):
        for index, item in enumerate(errors):
            if isinstance(item, (dict, list)):
                if item:
                    return _first_error(item, [*path, index])
            else:
                return path, str(item)
    return path, str(errors)


def validation_error(errors: dict) -> DomainError:
    """Turn DRF's field errors into one sentence naming the first bad field."""
    path, detail = _first_error(errors, [])
    param = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in path).lstrip(".") or None
    prefix = "" if param is None else f"'{param}': "
    return bad_request(f"{prefix}{detail}", code="invalid_value", param=param)


def api_exception_handler(exc: Exception, context: dict) -> HttpResponse | None:
    """DRF's handler, re-shaped into OpenAI's error format. A DomainError answers as at every
    other door, by `response()` (DRF takes any Django response here), so its `Retry-After`
    and headers reach the client."""
    if isinstance(exc, DomainError):
        return exc.response()
    if isinstance(exc, exceptions.ValidationError) and isinstance(exc.detail, dict):
        return validation_error(exc.detail).response()
    response = exception_handler(exc, context)
    if response is None:
        return None
    message = response.data.get("detail", str(exc)) if isinstance(response.data, dict) else str(exc)
    code = getattr(getattr(exc, "detail", None), "code", None) or "error"
    response.data = {"error": {"message": str(message), "type": "invalid_request_error", "param": None, "code": code}}
    return response
