"""Errors in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

from django.http import JsonResponse
from rest_framework import exceptions
from rest_framework.response import Response
from rest_framework.views import exception_handler


class ApiError(Exception):
    """An error a caller can act on; rendered with its status and code."""

    def __init__(self, status: int, message: str, *, code: str, type: str = "invalid_request_error", param: str | None = None) -> None:  # noqa: A002
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.type = type
        self.param = param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JsonResponse:
        return JsonResponse(self.body(), status=self.status)


def bad_request(message: str, *, code: str = "invalid_request", param: str | None = None) -> ApiError:
    return ApiError(400, message, code=code, param=param)


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


def validation_error(errors: dict) -> ApiError:
    """Turn DRF's field errors into one sentence naming the first bad field."""
    path, detail = _first_error(errors, [])
    param = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in path).lstrip(".") or None
    prefix = "" if param is None else f"'{param}': "
    return bad_request(f"{prefix}{detail}", code="invalid_value", param=param)


def api_exception_handler(exc: Exception, context: dict) -> Response | None:
    """DRF's handler, re-shaped into OpenAI's error format."""
    if isinstance(exc, ApiError):
        return Response(exc.body(), status=exc.status)
    if isinstance(exc, exceptions.ValidationError) and isinstance(exc.detail, dict):
        error = validation_error(exc.detail)
        return Response(error.body(), status=400)
    response = exception_handler(exc, context)
    if response is None:
        return None
    message = response.data.get("detail", str(exc)) if isinstance(response.data, dict) else str(exc)
    code = getattr(getattr(exc, "detail", None), "code", None) or "error"
    response.data = {"error": {"message": str(message), "type": "invalid_request_error", "param": None, "code": code}}
    return response
