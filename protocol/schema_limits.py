"""The limits on a customer's JSON Schema (`response_format`, the tools' parameters), the same
on the gateway and on every host.

A schema becomes a sampling grammar (llama.cpp's converter, on the host) and checks an answer
(on the gateway). Both costs grow with the numbers a schema holds: `minItems: 1e7` takes the
converter seconds and hundreds of MB, `maxLength: 2000` makes llama.cpp's grammar parser give
up (and llama-cpp-python then crashes the host), and a `pattern` like `^(a+)+$` takes Python's
`re` exponential time. So a schema is refused with a 400 that names the limit before any of
that work is done, and patterns are run by RE2, in linear time (see `pattern_problem`).

The bounds were measured on the shipped model (the grammar at each bound starts sampling
within about a second on one CPU thread); they are documented in README's API section.
No Django here.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

MAX_SCHEMA_CHARS = 64_000  # the schema as compact JSON
MAX_DEPTH = 16  # objects and arrays inside one another
MAX_NODES = 2_000  # objects in the schema (each subschema is one)
MAX_COUNT = 100  # minItems, maxItems, minProperties, maxProperties, minContains, maxContains
MAX_LENGTH = 1_000  # minLength, maxLength
MAX_ENUM = 500  # values of one enum
MAX_PATTERN_CHARS = 500
MAX_REPEAT = 100  # a pattern's {n}, {n,} and {n,m} bounds

COUNT_KEYWORDS = ("minItems", "maxItems", "minProperties", "maxProperties", "minContains", "maxContains")
LENGTH_KEYWORDS = ("minLength", "maxLength")
_REPEAT = re.compile(r"(?<!\\)\{(\d+)(?:,(\d*))?\}")


def schema_limit_problem(schema: Any, *, patterns: bool = True) -> str | None:
    """Which limit `schema` exceeds, in words that name it and its bound; None when it keeps all.
    Walked without recursion, so no nesting can exhaust the stack. `patterns=False` leaves out
    whether RE2 can run its patterns (a host, which never runs them, checks only the bounds)."""
    nodes, stack = 0, [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            return f"it nests objects and arrays more than {MAX_DEPTH} deep"
        if isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)
            continue
        if not isinstance(value, dict):
            continue
        nodes += 1
        if nodes > MAX_NODES:
            return f"it has more than {MAX_NODES:,} subschemas"
        problem = _node_problem(value, patterns=patterns)
        if problem:
            return problem
        stack.extend((item, depth + 1) for item in value.values())
    try:
        size = len(json.dumps(schema, separators=(",", ":")))
    except (TypeError, ValueError):
        return "it is not plain JSON"
    if size > MAX_SCHEMA_CHARS:
        return f"it is {size:,} characters of JSON; the limit is {MAX_SCHEMA_CHARS:,}"
    return None


def _node_problem(node: dict, *, patterns: bool) -> str | None:
    for keyword, bound in [*((k, MAX_COUNT) for k in COUNT_KEYWORDS), *((k, MAX_LENGTH) for k in LENGTH_KEYWORDS)]:
        number = node.get(keyword)
        if isinstance(number, (int, float)) and not isinstance(number, bool) and number > bound:
            return f"'{keyword}' is {_shown(number)}; the most this API takes is {bound:,}"
    enum = node.get("enum")
    if isinstance(enum, list) and len(enum) > MAX_ENUM:
        return f"an 'enum' lists {len(enum):,} values; the most this API takes is {MAX_ENUM}"
    found = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
    if isinstance(node.get("patternProperties"), dict):
        found += list(node["patternProperties"])
    for pattern in found:
        problem = pattern_problem(pattern, linear=patterns)
        if problem:
            return problem
    return None


def pattern_problem(pattern: str, *, linear: bool = True) -> str | None:
    """Why a schema's `pattern` is refused, or None. RE2 runs patterns in time linear in the
    text, so it has no lookahead, lookbehind or backreferences: a pattern that needs them is
    refused here (unless `linear` is False) rather than run by an engine that can take
    exponential time."""
    if len(pattern) > MAX_PATTERN_CHARS:
        return f"a 'pattern' is {len(pattern):,} characters; the limit is {MAX_PATTERN_CHARS}"
    for low, high in _REPEAT.findall(pattern):
        if int(low) > MAX_REPEAT or (high and int(high) > MAX_REPEAT):
            return f"a 'pattern' repeats {{{low},{high}}} times; the most this API takes is {MAX_REPEAT}"
    if not linear:
        return None
    try:
        linear_pattern(pattern)
    except ValueError as error:
        hint = (
            "; it has no lookahead, lookbehind or backreferences"
            if "perl operator" in str(error) or "escape sequence" in str(error)
            else ""
        )
        return f"the 'pattern' {pattern[:80]!r} cannot be run in linear time: RE2 refuses it ({error}{hint})"
    return None


@lru_cache(maxsize=512)
def linear_pattern(pattern: str):  # -> re2._Regexp
    """`pattern` compiled by RE2 (google-re2), once per process. Raises ValueError when RE2
    cannot run it."""
    import re2

    options = re2.Options()
    options.log_errors = False  # a refused pattern is the customer's 400, not a line in our logs
    try:
        return re2.compile(pattern, options=options)
    except re2.error as error:
        said = error.args[0] if error.args else error
        raise ValueError(said.decode(errors="replace") if isinstance(said, bytes) else str(said)) from None


def _shown(number: float) -> str:
    return f"{int(number):,}" if float(number).is_integer() and abs(number) < 1e18 else f"{number:g}"
