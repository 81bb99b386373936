"""The OpenAPI schema's conventions, written once (drf-spectacular generates the rest from the views).

* Credentials: a view names the one it reads in `security_scheme` (`API_KEY` for a
  customer's key, `HOST_TOKEN` for a host's token; both `Authorization: Bearer …`).
* Errors: every refusal is `core.errors`' one shape; each operation documents the refusals
  any call can meet (`COMMON_ERRORS`, and 403 where a host token is read), and a view
  adds its own (402, 409, 429, …) to its `responses` with `ERROR`.
* Request bodies: a view's nested `InputSerializer` (the house shape) is its request body;
  responses are named with `@extend_schema`.
* Event streams: a `text/event-stream` response is an `EventStream`: each event's `data` is
  one of its payloads as JSON, or the literal that ends the stream.
* Plain Django views (the async doors: a DRF view would hold a thread while a host works)
  are listed by routing them through `documented`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from django.conf import settings
from django.utils.translation import get_language
from django.views import View
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.plumbing import ResolvedComponent
from drf_spectacular.utils import Direction, OpenApiResponse
from rest_framework import serializers
from rest_framework.views import APIView

API_KEY = "ApiKey"
HOST_TOKEN = "HostToken"
SECURITY_SCHEMES = {
    API_KEY: {
        "type": "http",
        "scheme": "bearer",
        "description": "A customer's API key, as `Authorization: Bearer <key>`.",
    },
    HOST_TOKEN: {
        "type": "http",
        "scheme": "bearer",
        "description": "A host's token, as `Authorization: Bearer <token>`.",
    },
}

# What any call can be answered: malformed input (400), a missing or unknown credential
# (401), an unknown route or id (404), a body over the limit (413, refused before any view).
COMMON_ERRORS = (400, 401, 404, 413)
HOST_ERRORS = (403,)  # a banned host, or one whose owner is inactive, on every call


class ErrorDetailSerializer(serializers.Serializer):
    message = serializers.CharField()
    type = serializers.CharField(help_text="OpenAI's error type, e.g. invalid_request_error")
    param = serializers.CharField(allow_null=True, help_text="the request field at fault, if one is")
    code = serializers.CharField(help_text="what went wrong, for a program: e.g. insufficient_credit")


class ErrorSerializer(serializers.Serializer):
    """Every refusal, in OpenAI's format (`core.errors.DomainError.body`)."""

    error = ErrorDetailSerializer()


ERROR = OpenApiResponse(ErrorSerializer, description="An error, in OpenAI's format: the body says what went wrong.")


@dataclass(frozen=True)
class EventStream:
    """Server-Sent Events whose `data` is one of `payloads` (serializers) as JSON, or `done`.

    Documented (OpenAPI 3.1) as the schema of one event, the object OpenAPI 3.2 gives SSE:
    `{"data", "event", "id", "retry"}`, its `data` a JSON document (`contentSchema`)."""

    payloads: tuple[type[serializers.Serializer], ...]
    description: str = ""
    done: str | None = "[DONE]"


class ApiSchema(AutoSchema):
    """drf-spectacular's inspector, with this API's credentials, errors and component names."""

    def get_auth(self) -> list[dict[str, list]]:
        scheme = getattr(self.view, "security_scheme", None)
        if scheme is None:
            return []
        self.registry.register_on_missing(
            ResolvedComponent(
                name=scheme,
                type=ResolvedComponent.SECURITY_SCHEMA,
                object=scheme,
                schema=SECURITY_SCHEMES[scheme],
            )
        )
        return [{scheme: []}]

    def get_tags(self) -> list[str]:
        scheme = getattr(self.view, "security_scheme", None)
        tags: dict[str | None, list[str]] = {API_KEY: ["customer"], HOST_TOKEN: ["host"]}
        return tags.get(scheme, super().get_tags())

    def get_request_serializer(self) -> Any:
        own = getattr(self.view, "InputSerializer", None)
        return own if own is not None else super().get_request_serializer()

    def _get_response_bodies(self, direction: Direction = "response") -> dict:
        responses = super()._get_response_bodies(direction)
        errors = COMMON_ERRORS + (HOST_ERRORS if getattr(self.view, "security_scheme", None) == HOST_TOKEN else ())
        for status in errors:
            if str(status) not in responses:
                responses[str(status)] = self._get_response_for_code(ERROR, str(status), direction=direction)
        return dict(sorted(responses.items()))

    def _get_response_for_code(
        self,
        serializer: Any,
        status_code: str,
        media_types: Any = None,
        direction: Direction = "response",
    ) -> dict:
        if not isinstance(serializer, EventStream):
            return super()._get_response_for_code(serializer, status_code, media_types, direction)
        payloads = [self.resolve_serializer(payload(), direction).ref for payload in serializer.payloads]
        data: dict = {"type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": payloads}}
        if serializer.done is not None:
            data = {"anyOf": [data, {"const": serializer.done}]}
        event = {
            "type": "object",
            "required": ["data"],
            "properties": {
                "data": data,
                "event": {"type": "string"},
                "id": {"type": "string"},
                "retry": {"type": "integer"},
            },
        }
        return {
            "content": {media: {"schema": event} for media in media_types or ["text/event-stream"]},
            "description": serializer.description,
        }

    def get_serializer_name(self, serializer: serializers.Serializer, direction: str) -> str:
        """A nested serializer is named after its view: `JobClaimApi.InputSerializer` is
        `JobClaimInput` (every view's is called `InputSerializer`)."""
        parts = type(serializer).__qualname__.split(".")
        return "".join(part.removesuffix("Serializer").removesuffix("Api") for part in parts)


def documented(view: type[View]) -> Callable[..., Any]:
    """`view.as_view()` for a plain Django view, listed in the schema all the same.

    drf-spectacular lists only DRF views. The callback carries an `APIView` twin of `view`
    (the same methods, docstrings and `@extend_schema`), which the schema generator
    inspects and nothing serves: requests still go to `view`."""
    callback = view.as_view()
    twin = type(view.__name__, (view, APIView), {"__module__": view.__module__, "__doc__": view.__doc__})
    callback.cls = twin  # type: ignore[attr-defined]
    callback.initkwargs = {}  # type: ignore[attr-defined]
    return callback


class CachedSchemaGenerator(SchemaGenerator):
    """`GET /api/schema/`'s generator, generating once per process: the schema is the views'
    and the settings', the same for every caller (served public), and generating it costs far
    more than serving it (hundreds of operations inspected). One per API version and language
    asked for (`?version=`, `?lang=`): the plain one always, the first few others (a caller's
    own values cannot grow it, nor crowd the plain one out)."""

    kept: ClassVar[dict[tuple, dict]] = {}
    KEEP = 8

    def get_schema(self, request: Any = None, public: bool = False) -> dict:
        key = (self.urlconf, self.api_version, get_language(), public)
        schema = self.kept.get(key)
        if schema is None:
            schema = super().get_schema(request=request, public=public)
            plain = self.api_version is None and get_language() == settings.LANGUAGE_CODE
            if plain or len(self.kept) < self.KEEP:
                self.kept[key] = schema
        return schema
