"""How far the sampling grammar reaches into a customer's JSON Schema: which of its keywords the
grammar enforces, which it leaves out, and where it is looser than the schema.

A host samples a structured answer under the grammar that llama-cpp-python's converter
(`llama_cpp.llama_grammar.json_schema_to_gbnf`, the one `protocol.grammar_fence` runs) makes from
the schema; the gateway then checks the answer with `jsonschema` (`marketplace.lifecycle.structured`).
Every keyword `jsonschema` checks that the grammar leaves out is a way for an honest host's
answer to be refused. So:

- a keyword the grammar leaves out is refused at admission (`unenforced`), naming it and where
  it is in the schema: nothing a customer sends may count against an honest host;
- where the grammar is known to be looser than the schema and refusing would turn away common
  schemas (`oneOf` alternatives that may overlap, string patterns that let a quote or a backslash
  into the JSON text, escapes counted as characters), the schema is taken, and an answer that
  fails only there is the request's failure, not its host's (`loose`, used by
  `structured.answer_refusal`).

`BRANCHES` is data read off the converter's source (llama-cpp-python 0.3.36,
`llama_cpp/llama_grammar.py: SchemaConverter.visit`): `visit` is one if/elif chain, the first
branch whose condition a (sub)schema meets builds that schema's whole rule, and it reads only the
keywords listed for it. Every other keyword of that (sub)schema that `jsonschema` would check is
not enforced, unless it cannot apply to the values the branch produces (`maxLength` beside
`"type": "integer"`). `marketplace/tests/test_schema_reach.py` holds the list to the converter:
each keyword listed as read changes the grammar, each one refused does not. Bump both with the
converter.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from marketplace.lifecycle.linear_schema import schema_validator

NUMBERS = frozenset({"number", "integer"})
ANY = None  # a branch whose values may be of any JSON type


@dataclass(frozen=True)
class Branch:
    """One branch of `SchemaConverter.visit`, in its order: when it applies, the keywords it turns
    into grammar, and the JSON types of the values its rule can produce (None: any)."""

    name: str
    applies: Callable[[dict], bool]
    reads: frozenset[str]
    makes: Callable[[dict], frozenset[str] | None]


def _type(node: dict) -> object:
    return node.get("type")


def _kinds(node: dict) -> frozenset[str]:
    kinds = frozenset(t for t in node["type"] if isinstance(t, str))
    return kinds | {"integer"} if "number" in kinds else kinds


def _is_object_rule(node: dict) -> bool:
    return _type(node) in (None, "object") and (
        "properties" in node or ("additionalProperties" in node and node["additionalProperties"] is not True)
    )


STRING_FORMATS = ("date", "time", "date-time")  # STRING_FORMAT_RULES' "<format>-string" rules


def _primitive(node: dict) -> frozenset[str] | None:
    kind = _type(node)
    return NUMBERS if kind == "number" else frozenset({kind}) if isinstance(kind, str) else ANY


BRANCHES: tuple[Branch, ...] = (
    Branch("$ref", lambda n: n.get("$ref") is not None, frozenset({"$ref"}), lambda n: ANY),
    # `schema.get("oneOf") or schema["anyOf"]`: a non-empty oneOf hides an anyOf beside it
    Branch("union", lambda n: "oneOf" in n or "anyOf" in n, frozenset(), lambda n: ANY),
    Branch("type list", lambda n: isinstance(_type(n), list), frozenset({"type"}), _kinds),
    # the only value it produces is checked against the whole subschema (`_literal_problem`)
    Branch("const", lambda n: "const" in n, frozenset({"const"}), lambda n: ANY),
    Branch("enum", lambda n: "enum" in n, frozenset({"enum"}), lambda n: ANY),
    Branch(
        "object",
        _is_object_rule,
        frozenset({"type", "properties", "required", "additionalProperties"}),
        lambda n: frozenset({"object"}),
    ),
    # merges only the `properties` of its parts (and of their anyOf's parts, made optional)
    Branch(
        "allOf",
        lambda n: _type(n) in (None, "object") and "allOf" in n,
        frozenset({"type"}),
        lambda n: frozenset({"object"}),
    ),
    # `schema.get("items") or schema["prefixItems"]`: a list makes a tuple of exactly that length
    Branch(
        "array",
        lambda n: _type(n) in (None, "array") and ("items" in n or "prefixItems" in n),
        frozenset({"type", "items", "prefixItems", "minItems", "maxItems", "additionalItems"}),
        lambda n: frozenset({"array"}),
    ),
    Branch(
        "pattern",
        lambda n: _type(n) in (None, "string") and "pattern" in n,
        frozenset({"type", "pattern"}),
        lambda n: frozenset({"string"}),
    ),
    Branch(
        "uuid",
        lambda n: _type(n) in (None, "string") and re.match(r"^uuid[1-5]?$", str(n.get("format") or "")) is not None,
        frozenset({"type", "format"}),
        lambda n: frozenset({"string"}),
    ),
    Branch(
        "format",
        lambda n: _type(n) in (None, "string") and n.get("format") in STRING_FORMATS,
        frozenset({"type", "format"}),
        lambda n: frozenset({"string"}),
    ),
    Branch(
        "length",
        lambda n: _type(n) == "string" and ("minLength" in n or "maxLength" in n),
        frozenset({"type", "minLength", "maxLength"}),
        lambda n: frozenset({"string"}),
    ),
    Branch(
        "any object",
        lambda n: _type(n) == "object" or len(n) == 0,
        frozenset({"type"}),
        lambda n: frozenset({"object"}),
    ),
    # "TODO: support minimum, maximum, exclusiveMinimum, exclusiveMaximum" (the converter's own words)
    Branch("primitive", lambda n: True, frozenset({"type"}), _primitive),
)

# The instance types a keyword constrains (`jsonschema` passes over a value of another type);
# a keyword not named here can refuse a value of any type.
APPLIES_TO: dict[str, frozenset[str]] = {
    **dict.fromkeys(
        ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "divisibleBy"), NUMBERS
    ),
    **dict.fromkeys(("minLength", "maxLength", "pattern", "format"), frozenset({"string"})),
    **dict.fromkeys(
        (
            "items",
            "prefixItems",
            "additionalItems",
            "minItems",
            "maxItems",
            "uniqueItems",
            "contains",
            "unevaluatedItems",
        ),
        frozenset({"array"}),
    ),
    **dict.fromkeys(
        (
            "properties",
            "required",
            "additionalProperties",
            "patternProperties",
            "propertyNames",
            "minProperties",
            "maxProperties",
            "dependentRequired",
            "dependentSchemas",
            "dependencies",
            "unevaluatedProperties",
        ),
        frozenset({"object"}),
    ),
}
# Values with which a keyword constrains nothing: no grammar needed.
VACUOUS: dict[str, object] = {
    "uniqueItems": False,
    "minItems": 0,
    "minLength": 0,
    "minProperties": 0,
    "additionalProperties": True,
    "unevaluatedProperties": True,
    "unevaluatedItems": True,
}
# `jsonschema` checks `format` only with a format checker, which the gateway does not give it
# (`structured.schema_validator`): an annotation there, and the grammar's date and uuid rules only narrow it.
NOT_CHECKED = frozenset({"format"})


@dataclass(frozen=True)
class Unenforced:
    """A keyword the grammar does not enforce, where it is (`$.properties.age`) and, where it
    helps, why."""

    keyword: str
    where: str
    why: str = ""

    def sentence(self, subject: str = "it") -> str:
        because = f" ({self.why})" if self.why else ""
        return (
            f"{subject} uses '{self.keyword}' at {self.where}{because}, "
            "which this service cannot enforce: hosts sample "
            "under a grammar made from the schema by llama.cpp's converter, which leaves it out, so a correct answer "
            f"could still break it. Remove '{self.keyword}' there (and check it in your own code)"
        )


@dataclass(frozen=True)
class Reach:
    """What the grammar made from a schema does not enforce (`unenforced`, refused at admission)
    and where it is looser than the schema (`loose`: (keyword, where) pairs, see `LOOSE`)."""

    unenforced: tuple[Unenforced, ...]
    loose: tuple[tuple[str, str], ...]


def unenforced(schema: dict) -> Unenforced | None:
    """The first keyword of `schema` that the sampling grammar would leave out, or None."""
    found = reach(schema).unenforced
    return found[0] if found else None


def reach(schema: dict) -> Reach:
    """Walk `schema` as the converter visits it (following its `$ref`s, each subschema once)."""
    validator = schema_validator(schema)
    checked = frozenset(type(validator).VALIDATORS) - NOT_CHECKED
    problems: list[Unenforced] = []
    loose: list[tuple[str, str]] = []
    stack: list[tuple[Any, str]] = [(schema, "$")]
    seen: set[int] = set()
    while stack:
        node, where = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue  # (a boolean subschema: the converter refuses it, `grammar_problem` says so)
        seen.add(id(node))
        if "$id" in node and where != "$":
            problems.append(Unenforced("$id", where, "the grammar resolves every '$ref' from the root"))
        branch = next(b for b in BRANCHES if b.applies(node))
        problems += _left_out(node, where, branch, checked)
        problems += _branch_problems(node, where, branch, validator)
        loose += _looseness(node, where, branch)
        stack.extend(reversed(_children(node, where, branch, schema)))
    return Reach(tuple(problems), tuple(loose))


def _left_out(node: dict, where: str, branch: Branch, checked: frozenset[str]) -> list[Unenforced]:
    if branch.name in ("const", "enum"):
        return []  # its values are checked against every keyword instead (`_branch_problems`)
    makes = branch.makes(node)
    read = branch.reads | ({"oneOf"} if node.get("oneOf") else {"anyOf"}) if branch.name == "union" else branch.reads
    found = []
    for keyword, value in node.items():
        if keyword not in checked or keyword in read:
            continue
        if keyword in VACUOUS and type(value) is type(VACUOUS[keyword]) and value == VACUOUS[keyword]:
            continue
        applies = APPLIES_TO.get(keyword)
        if makes is ANY or applies is None or makes & applies:
            found.append(Unenforced(keyword, where, _why(keyword, branch)))
    return found


def _why(keyword: str, branch: Branch) -> str:
    if branch.name in ("$ref", "union", "type list"):
        beside = {"$ref": "'$ref'", "union": "'anyOf' or 'oneOf'", "type list": "a list of types"}[branch.name]
        return f"beside {beside}, whose grammar is all this subschema gets"
    if keyword == "allOf":
        return "the grammar merges only the 'properties' of its parts"
    return ""


def _branch_problems(node: dict, where: str, branch: Branch, validator: Any) -> list[Unenforced]:
    """What a branch reads but cannot hold to: values beside `const`/`enum`, `required` names that
    are no property, extra keys that may repeat a property, bounds the other way round, tuples."""
    if branch.name in ("const", "enum"):
        return _literal_problems(node, where, branch.name, validator)
    found = []
    if branch.name == "object":
        properties = node["properties"] if isinstance(node.get("properties"), dict) else {}
        required = node["required"] if isinstance(node.get("required"), list) else []
        missing = [str(name) for name in required if name not in properties]
        if missing:
            found.append(
                Unenforced("required", where, f"it names {missing[0][:64]!r}, which is not among 'properties'")
            )
        extra = node.get("additionalProperties")
        if properties and (extra is True or isinstance(extra, dict)):
            found.append(
                Unenforced(
                    "additionalProperties",
                    where,
                    "beside 'properties': the grammar's extra keys may "
                    "repeat a listed property with a value its schema refuses",
                )
            )
    for low, high in (("minItems", "maxItems"), ("minLength", "maxLength")):
        if (
            low in branch.reads
            and isinstance(node.get(low), (int, float))
            and isinstance(node.get(high), (int, float))
            and node[low] > node[high]
        ):
            found.append(Unenforced(low, where, f"it is more than '{high}'"))
    if branch.name == "array" and isinstance(node.get("items") or node.get("prefixItems"), list):
        size = len(node.get("items") or node["prefixItems"])  # a tuple: exactly this many items
        for keyword, holds in (("minItems", lambda n: size >= n), ("maxItems", lambda n: size <= n)):
            if isinstance(node.get(keyword), (int, float)) and not holds(node[keyword]):
                found.append(Unenforced(keyword, where, f"the grammar makes a tuple of exactly {size} items"))
    if branch.name == "array" and node.get("items") and node.get("prefixItems"):
        found.append(Unenforced("prefixItems", where, "beside 'items', which the grammar takes instead"))
    return found


def _literal_problems(node: dict, where: str, keyword: str, validator: Any) -> list[Unenforced]:
    """A `const` or `enum` subschema's grammar is its values, nothing else: each must meet the
    subschema's other keywords, or an answer that gives it is refused."""
    values = [node["const"]] if keyword == "const" else node["enum"] if isinstance(node.get("enum"), list) else []
    for value in values:
        errors = list(validator.evolve(schema=node).iter_errors(value))
        if errors:
            return [
                Unenforced(
                    errors[0].validator,
                    where,
                    f"beside '{keyword}', whose values are all the grammar allows, and one of them breaks it",
                )
            ]
    return []


# Where the grammar is looser than the schema it was made from, though it reads the keyword:
# taken at admission (refusing would turn away common schemas), and an answer that fails there
# is the request's failure, not its host's (`structured.answer_refusal`).
LOOSE: dict[str, str] = {
    "oneOf": "its grammar allows any of the alternatives, even one that another alternative also matches "
    "(use 'anyOf' if that is what you mean)",
    "pattern": "its grammar matches the pattern against the JSON text between the quotes, where a quote, a "
    "backslash or a control character it lets in is not the character it stands for",
    "minLength": "its grammar counts each \\u escape as one character, and JSON reads a surrogate pair of two as one",
}


def _looseness(node: dict, where: str, branch: Branch) -> list[tuple[str, str]]:
    """(keyword, where) for each way the grammar of this subschema is looser than it (`LOOSE`)."""
    if branch.name == "union" and node.get("oneOf"):
        return [("oneOf", where)]
    if branch.name == "pattern" and isinstance(node.get("pattern"), str) and raw_pattern_leaks(node["pattern"]):
        return [("pattern", where)]
    if branch.name == "length" and isinstance(node.get("minLength"), (int, float)) and node["minLength"] >= 2:
        return [("minLength", where)]
    return []


def _children(node: dict, where: str, branch: Branch, root: dict) -> list[tuple[Any, str]]:
    """The subschemas the converter visits next from `node`, with where they are."""
    if branch.name == "$ref":
        target, at = _resolved(root, node["$ref"])
        return [(target, at)] if target is not None else []
    if branch.name == "union":
        key = "oneOf" if node.get("oneOf") else "anyOf"
        return [(alt, f"{where}.{key}[{i}]") for i, alt in enumerate(node.get(key) or [])]
    if branch.name == "object":
        properties = node["properties"] if isinstance(node.get("properties"), dict) else {}
        found = [(value, f"{where}.properties{_key(name)}") for name, value in properties.items()]
        if isinstance(node.get("additionalProperties"), dict):
            found.append((node["additionalProperties"], f"{where}.additionalProperties"))
        return found
    if branch.name == "array":
        key = "items" if node.get("items") else "prefixItems"
        items = node.get(key)
        return (
            [(item, f"{where}.{key}[{i}]") for i, item in enumerate(items)]
            if isinstance(items, list)
            else [(items, f"{where}.{key}")]
        )
    return []


def _resolved(root: dict, ref: object) -> tuple[Any, str]:
    """A local `$ref` ("#/..."), read as the converter reads it (no JSON-pointer escapes); other
    refs the converter refuses (`grammar_problem` says so)."""
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return None, ""
    target: Any = root
    for part in ref[2:].split("/"):
        if not isinstance(target, dict) or part not in target:
            return None, ""
        target = target[part]
    return target, "$" + "".join(_key(part) for part in ref[2:].split("/"))


def _key(name: str) -> str:
    return f".{name}" if re.fullmatch(r"[A-Za-z_$][A-Za-z0-9_$-]*", name) else f"[{name!r}]"


PROBES = ('"', "\\", *map(chr, range(0x20)))  # what must not stand raw in a JSON string


@lru_cache(maxsize=256)
def raw_pattern_leaks(pattern: str) -> bool:
    """Whether the converter's rule for `pattern` may let a quote, a backslash or a control
    character into the answer's JSON text. Its rule is the pattern itself, written into the JSON
    string raw (`SchemaConverter._visit_pattern`): '.', a class that takes one of those, or a
    literal quote or backslash does."""
    at = 0
    while at < len(pattern):
        char = pattern[at]
        if char == "\\":
            if pattern[at + 1 : at + 2] in ('"', "\\"):
                return True
            at += 2
        elif char == "[":
            end = at + 1
            while end < len(pattern) and pattern[end] != "]":
                end += 2 if pattern[end] == "\\" else 1
            try:
                taken = re.compile(pattern[at : end + 1])
            except re.error:
                return True
            if any(taken.fullmatch(probe) for probe in PROBES):
                return True
            at = end + 1
        elif char in '."':
            return True
        else:
            at += 1
    return False
