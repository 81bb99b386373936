"""Structured output (`response_format`): what the gateway checks before and after a host
samples under a grammar.

Before: the schema is a valid JSON Schema, llama.cpp's JSON-schema-to-grammar converter (the
one every host runs) accepts it, and the grammar it makes enforces every keyword `jsonschema`
will hold the answer to (`marketplace.lifecycle.schema_reach`): a schema no host can follow, or one it
could follow and still be refused, is the customer's 400 (`schema_refusal`), never a host's
failure. After: the delivered answer is JSON and, for `json_schema`, valid against it
(`jsonschema`). An answer that is not is the host's failure, unless the grammar it sampled
under would have let it through (`answer_refusal`): then it is the request's. An answer cut
by `max_tokens` (finish_reason "length") is left as it is, as OpenAI leaves it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from marketplace.lifecycle.errors import InvalidStructuredOutput, RequestNotRunnable
from marketplace.lifecycle.linear_schema import schema_validator
from marketplace.lifecycle.schema_reach import LOOSE, reach
from protocol.schema_limits import schema_limit_problem

if TYPE_CHECKING:
    from jsonschema.exceptions import ValidationError
    from jsonschema.protocols import Validator


def schema_problem(schema: dict) -> str | None:
    """Why `schema` cannot constrain an answer, or None: first the limits every host keeps
    (`protocol.schema_limits`: no work on a schema past them), then whether it is a JSON Schema
    and llama.cpp's converter takes it."""
    from jsonschema import exceptions, validators

    from marketplace.lifecycle.grammar_check import grammar_problem

    too_much = schema_limit_problem(schema)
    if too_much:
        return too_much
    try:
        validators.validator_for(schema).check_schema(schema)
    except exceptions.SchemaError as exc:
        return exc.message
    return grammar_problem(json.dumps(schema, sort_keys=True))  # in a child process, with a time and memory bound


def schema_refusal(schema: dict) -> str | None:
    """Why `schema` is refused, as the rest of a sentence whose subject is the schema ("... is
    not a usable JSON Schema: ...", "... is refused: it uses 'minimum' at $.properties.age,
    which this service cannot enforce ..."), or None. The one check every door that samples
    under a schema's grammar makes (`response_format`, `text.format`, a forced tool call)."""
    why = schema_problem(schema)
    if why:
        return f"is not a usable JSON Schema: {why}"
    left_out = reach(schema).unenforced
    return f"is refused: {left_out[0].sentence()}" if left_out else None


def answer_problem_ahead(response_format: dict | None, text: str) -> None:
    """Check an answer before settlement takes its locks: `answer_problem` then finds the
    verdict for the same format and text here instead of validating inside the transaction
    (which on SQLite holds the database's one write lock)."""
    if response_format:
        _verdict(json.dumps(response_format, sort_keys=True), text)


@lru_cache(maxsize=16)
def _verdict(response_format: str, text: str) -> str | None:
    return _answer_problem(json.loads(response_format), text)


def answer_problem(response_format: dict | None, text: str) -> str | None:
    """Why a finished answer does not meet `response_format`, or None (a verdict made by
    `answer_problem_ahead` for this very text is reused)."""
    if not response_format:
        return None
    return _verdict(json.dumps(response_format, sort_keys=True), text)


@dataclass(frozen=True)
class Refusal:
    """How a finished answer that breaks its `response_format` ends: whose failure it is
    (`cause`, as `Job.fail_cause`), the request's error code and message, and the job's
    `fail_reason`."""

    cause: str  # "host" or "request"
    code: str
    message: str
    why: str


def answer_refusal(params: dict, text: str, problem: str) -> Refusal:
    """Whose failure an answer that breaks its `response_format` (`problem`) is.

    The host's, when the grammar it was sent would have kept the answer out: text that is not
    JSON, or not an object for `json_object` (llama.cpp's JSON grammar), or JSON that breaks a
    keyword the schema's grammar enforces. Nothing is paid and the failure counts toward the
    host's rest (`host_rest_if_unreliable`).

    The request's, when an honest host sampling under that grammar could have written it
    (`grammar_let_through`): a stop sequence of the request's own cut the JSON, the schema uses
    a keyword the grammar leaves out (admitted before `schema_refusal` refused such schemas), or
    the answer fails where the grammar is known to be looser than the schema
    (`schema_reach.LOOSE`). Nothing is billed, the customer is told why, and the host is not
    blamed (`Job.fail_cause` "request": no step toward its rest)."""
    excuse = grammar_let_through(params, text)
    if excuse is None:
        return Refusal(
            cause="host",
            code=InvalidStructuredOutput.code,
            why=f"structured output: {problem}",
            message=f"The host's answer did not meet response_format ({problem}); nothing was billed.",
        )
    return Refusal(
        cause="request",
        code=RequestNotRunnable.code,
        why=f"structured output, not the host's doing: {problem}; {excuse}"[:500],
        message=(
            f"The answer did not meet response_format ({problem}), though it kept to the grammar hosts sample under: "
            f"{excuse}. Nothing was billed, and no host is blamed."
        ),
    )


def grammar_let_through(params: dict, text: str) -> str | None:
    """Why a host sampling under the request's grammar could have written this failing answer,
    or None when the grammar would have kept it out."""
    response_format = params.get("response_format") or {}
    if params.get("stop"):
        return "a stop sequence of the request's own may have cut the JSON (send no 'stop' with a response_format)"
    if response_format.get("type") != "json_schema":
        return None  # (llama.cpp's JSON grammar: any object, nothing looser)
    schema = response_format.get("schema") or {}
    found = reach(schema)
    loose = dict(reversed(found.loose))  # keyword -> its first place
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # only a pattern written raw into the JSON lets non-JSON through
        return f"its 'pattern' at {loose['pattern']}: {LOOSE['pattern']}" if "pattern" in loose else None
    if found.unenforced:  # (a schema admitted before `schema_refusal` refused it)
        return found.unenforced[0].sentence("the schema")
    if "oneOf" in loose and _grammar_view(schema).is_valid(value):
        return f"its 'oneOf' at {loose['oneOf']}: {LOOSE['oneOf']}"
    loose.pop("oneOf", None)
    for keyword, where in loose.items():
        return f"its '{keyword}' at {where}: {LOOSE[keyword]}"
    return None


def _grammar_view(schema: dict) -> Validator:
    """A validator for `schema` that reads `oneOf` as the grammar does: as `anyOf`."""
    from jsonschema import validators

    cls = type(schema_validator(schema))
    return validators.extend(cls, {"oneOf": cls.VALIDATORS["anyOf"]})(schema)


def _answer_problem(response_format: dict | None, text: str) -> str | None:
    """Why a finished answer does not meet `response_format`, or None.

    In our words and the schema's, never quoting the answer: the reason outlives it (in
    `Request.error_message` and `Job.fail_reason`), and jsonschema's own messages repeat
    the offending value."""
    if not response_format:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"the answer is not JSON ({exc.msg} at character {exc.pos})"
    except ValueError:  # (a number past Python's digit limit)
        return "the answer is not JSON that can be read"
    except RecursionError:
        return "the answer nests arrays and objects too deep to read"
    if response_format["type"] == "json_object":
        return None if isinstance(value, dict) else "the answer is JSON but not an object"
    from jsonschema import exceptions

    schema = response_format.get("schema") or {}
    try:
        schema_validator(schema).validate(value)
    except exceptions.ValidationError as exc:
        return f"the answer does not match the schema: {_broken_rule(exc)}"[:300]
    except RecursionError:
        return "the answer nests arrays and objects too deep to check"
    return None


def _broken_rule(error: ValidationError) -> str:
    """The schema rule an answer breaks, named by the schema's keyword and path (the customer's
    own words), with the property a `required` misses; nothing of the answer's."""
    where = "/".join(str(part) for part in error.schema_path) or "the root"
    if error.validator == "required" and isinstance(error.instance, dict):
        missing = [name for name in error.validator_value if name not in error.instance]
        if missing:
            return f"the required property '{missing[0]}' is missing (at {where})"
    return f"its '{error.validator}' rule is broken (at {where})"
