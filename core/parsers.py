"""JSON as every door reads it, the HTTP views' `json_body`, DRF's parser and the WebSocket
consumers alike: finite numbers only, and nested no deeper than a reader can walk.

Apart from `core.http` because DRF imports its parser while `core.errors` is still loading.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import IO, Any

from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser


class NotFinite(ValueError):
    """NaN or ±Infinity: Python's JSON reader takes them, JSON does not, and a runner breaks on them."""


def reject_non_finite(constant: str) -> object:
    raise NotFinite(constant)


class TooDeep(ValueError):
    """JSON nested past MAX_JSON_DEPTH: Python's reader and every walk over the value recurse,
    so a deep enough body would end in a RecursionError (a 500) wherever it is first walked."""


MAX_JSON_DEPTH = 64  # arrays and objects inside each other; far past any request or schema we serve


def json_loads(text: str | bytes) -> object:
    """JSON as every door reads it: finite numbers only (`NotFinite`), nested at most
    MAX_JSON_DEPTH deep (`TooDeep`); both are ValueErrors, like any other text that is not JSON."""
    try:
        value = json.loads(text, parse_constant=reject_non_finite)
    except RecursionError:
        raise TooDeep(f"arrays and objects nest more than {MAX_JSON_DEPTH} deep") from None
    if json_depth(value) > MAX_JSON_DEPTH:
        raise TooDeep(f"arrays and objects nest more than {MAX_JSON_DEPTH} deep")
    return value


def json_depth(value: object) -> int:
    """How deep arrays and objects nest in a value read from JSON (a scalar is 0), without recursing."""
    deepest, level = 0, [(value, 1)]
    while level:
        item, depth = level.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        level.extend((child, depth + 1) for child in children)
    return deepest


class JsonParser(JSONParser):
    """DRF's JSON parser (`REST_FRAMEWORK`'s only one), reading as every other door does
    (`json_loads`): a body nested too deep is a ParseError, a 400, not a RecursionError."""

    def parse(
        self, stream: IO[Any], media_type: str | None = None, parser_context: Mapping[str, Any] | None = None
    ) -> Any:  # noqa: ANN401
        encoding = (parser_context or {}).get("encoding", settings.DEFAULT_CHARSET)
        try:
            return json_loads(stream.read().decode(encoding))
        except ValueError as exc:  # (UnicodeDecodeError, NotFinite and TooDeep among them)
            raise ParseError(f"JSON parse error - {exc}") from None
