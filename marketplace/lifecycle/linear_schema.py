"""A customer's JSON Schema checked in linear time: `jsonschema`'s validator for it, with
`pattern` and `patternProperties` run in RE2 (`protocol.schema_limits.linear_pattern`), never
in Python's `re`. Used where a schema's keywords are read (`marketplace.lifecycle.schema_reach`) and
where answers are checked against it (`marketplace.lifecycle.structured`, `marketplace.openai.tool_calls`)."""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any

from protocol.schema_limits import linear_pattern

if TYPE_CHECKING:
    from jsonschema.protocols import Validator


def schema_validator(schema: dict) -> Validator:
    """A jsonschema validator for `schema` whose `pattern` and `patternProperties` run in RE2
    (linear time), never in Python's `re`: a customer's pattern must not be able to stall a
    gateway process on an answer (`^(a+)+$` against 23 a's and a "!" took `re` 0.57 s, doubling
    per character)."""
    from jsonschema import validators

    return _linear(validators.validator_for(schema))(schema)


@lru_cache(maxsize=8)
def _linear(cls: type) -> type:
    from jsonschema import validators

    return validators.extend(cls, {"pattern": _pattern, "patternProperties": _pattern_properties})


def _pattern(validator: Any, pattern: str, instance: Any, schema: dict) -> Any:
    from jsonschema.exceptions import ValidationError

    if validator.is_type(instance, "string") and linear_pattern(pattern).search(instance) is None:
        yield ValidationError(f"does not match the pattern {pattern!r}")


def _pattern_properties(validator: Any, patterns: dict, instance: Any, schema: dict) -> Any:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        compiled = linear_pattern(pattern)
        for name, value in instance.items():
            if compiled.search(name) is not None:
                yield from validator.descend(value, subschema, path=name, schema_path=pattern)
