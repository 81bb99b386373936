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


def validation_error(errors: dict) -> ApiError:
    """Turn DRF's field errors into one sentence naming the first bad field."""
    field, problems = next(iter(errors.items()))
    detail = problems[0] if isinstance(problems, list) and problems else problems
    if isinstance(detail, dict):  # nested serializer (e.g. messages[0].role)
        inner_field, inner = next(iter(detail.items()))
        field = f"{field}.{inner_field}"
        detail = inner[0] if isinstance(inner, list) else inner
    if isinstance(problems, list) and problems and isinstance(problems[0], dict):  # list of nested
        for index, item in enumerate(problems):
            if item:
                inner_field, inner = next(iter(item.items()))
                field, detail = f"{field}[{index}].{inner_field}", inner[0] if isinstance(inner, list) else inner
                break
    param = None if field == "non_field_errors" else field
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
