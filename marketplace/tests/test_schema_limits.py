"""A customer's schema cannot stall a gateway process or a host (issue 30), written as the attacks:
a schema past a documented limit is a 400 that names it before any grammar is built; patterns
run in RE2's linear time on the answer; and the schema's checks run off the event loop.
(Hosts keep the same limits: `mahout/tests/test_schema_limits_host.py`.)"""

from __future__ import annotations

import asyncio
import threading

import pytest
from django.test import Client

from marketplace.lifecycle import grammar_check
from marketplace.lifecycle.structured import answer_problem, schema_problem
from marketplace.models import Request
from marketplace.openai.choices import admit_choices
from marketplace.openai.serializers import ChatInputSerializer
from marketplace.openai.tool_calls import tool_calls_in, tools_spec
from marketplace.tests.test_apis import assert_error, post
from protocol import schema_limits
from protocol.schema_limits import MAX_COUNT, MAX_DEPTH, MAX_LENGTH, schema_limit_problem

REDOS = "^(a+)+$"  # Python's re: 0.57 s at 23 a's and a "!", doubling per character


def chat(schema: dict) -> dict:
    return {
        "model": "gemma-3-270m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    }


def deep(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.fixture
def no_grammar(monkeypatch: pytest.MonkeyPatch) -> None:
    def built(*args: object, **kwargs: object) -> None:
        raise AssertionError("a grammar was built for a schema past the limits")

    monkeypatch.setattr(grammar_check, "grammar_problem", built)


@pytest.mark.django_db(transaction=True)
class GoodKeyTests:
    def test_the_ten_million_item_schema_is_a_400_naming_the_limit_and_no_grammar_is_built(
        self, customer, no_grammar
    ) -> None:
        schema = {"type": "array", "items": {"type": "string"}, "minItems": 10_000_000}
        error = assert_error(post(Client(), customer.secret, chat(schema)), 400, "invalid_value")
        assert error["param"] == "response_format"
        assert "'minItems' is 10,000,000" in error["message"] and f"{MAX_COUNT}" in error["message"]
        assert not Request.objects.exists()

    def test_a_lookahead_pattern_is_a_400_that_says_why(self, customer) -> None:
        error = assert_error(
            post(Client(), customer.secret, chat({"type": "string", "pattern": "^(?=a)a+$"})), 400, "invalid_value"
        )
        assert "linear time" in error["message"] and "lookahead" in error["message"]

    def test_a_tool_past_the_limits_is_a_400_on_tools(self, customer, no_grammar) -> None:
        body = {
            "model": "gemma-3-270m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8,
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {
                            "type": "object",
                            "properties": {"x": {"type": "string", "maxLength": 1_000_000}},
                        },
                    },
                }
            ],
        }
        error = assert_error(post(Client(), customer.secret, body), 400, "invalid_value")
        assert error["param"] == "tools" and "'maxLength' is 1,000,000" in error["message"]

    def test_the_schema_is_checked_off_the_event_loop(self, customer, monkeypatch) -> None:
        seen: list[threading.Thread] = []
        checked = ChatInputSerializer.is_valid

        def is_valid(self, *args, **kwargs):
            seen.append(threading.current_thread())
            return checked(self, *args, **kwargs)

        monkeypatch.setattr(ChatInputSerializer, "is_valid", is_valid)

        async def admit() -> threading.Thread:
            loop_thread = threading.current_thread()
            with pytest.raises(Exception) as refused:  # (the 400 is enough: the validation ran)
                await admit_choices(
                    secret=customer.secret, body=chat({"type": "string", "maxLength": 5000}), kind=Request.Kind.CHAT
                )
            assert getattr(refused.value, "status", None) == 400
            return loop_thread

        loop_thread = asyncio.run(admit())
        assert seen and seen[0] is not loop_thread


class LimitTests:
    @pytest.mark.parametrize(
        ("schema", "said"),
        [
            ({"type": "array", "items": {"type": "string"}, "maxItems": MAX_COUNT + 1}, "'maxItems' is 101"),
            ({"type": "object", "minProperties": 1e9}, "'minProperties' is 1,000,000,000"),
            (
                {"type": "string", "maxLength": 2000},
                "'maxLength' is 2,000",
            ),  # (llama.cpp's grammar parser gives up here)
            ({"type": "string", "minLength": MAX_LENGTH + 1}, "'minLength' is 1,001"),
            ({"enum": list(range(501))}, "'enum' lists 501 values"),
            ({"type": "string", "pattern": "a" * 501}, "'pattern' is 501 characters"),
            ({"type": "string", "pattern": "^[a-z]{101}$"}, "repeats {101,} times"),
            ({"type": "string", "pattern": "^a{1,1000}$"}, "repeats {1,1000} times"),
            (
                {"type": "object", "patternProperties": {"(a)\\1": {"type": "string"}}},
                "no lookahead, lookbehind or backreferences",
            ),
            ({"type": "string", "pattern": "^(a{1,100}){1,100}$"}, "RE2 refuses it (invalid repetition size"),
            (deep(MAX_DEPTH), f"more than {MAX_DEPTH} deep"),
            ({"type": "object", "description": "x" * 70_000}, "characters of JSON; the limit is 64,000"),
            (
                {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2001)}},
                "more than 2,000 subschemas",
            ),
        ],
    )
    def test_a_schema_past_a_limit_is_refused_naming_it(self, schema, said) -> None:
        problem = schema_problem(schema)
        assert problem is not None and said in problem, problem

    @pytest.mark.parametrize(
        "schema",
        [
            {
                "type": "array",
                "items": {"type": "string", "maxLength": MAX_LENGTH},
                "minItems": 1,
                "maxItems": MAX_COUNT,
            },
            {"type": "string", "pattern": "^(a{1,10}){1,100}$"},
            {"type": "object", "properties": {"minItems": {"type": "integer"}, "maxLength": {"type": "string"}}},
            deep(MAX_DEPTH // 2 - 1),
        ],
    )
    def test_a_schema_within_the_limits_is_taken(self, schema) -> None:
        assert schema_problem(schema) is None

    def test_the_walk_survives_any_nesting(self) -> None:
        value: object = {}
        for _ in range(100_000):
            value = [value]
        assert "deep" in (schema_limit_problem({"enum": value}) or "")  # (before json.dumps, which would recurse)


class LinearPatternTests:
    def test_the_redos_pattern_checks_a_40_character_answer_at_once(self) -> None:
        response_format = {"type": "json_schema", "schema": {"type": "string", "pattern": REDOS}}
        problem = answer_problem(response_format, '"' + "a" * 40 + '!"')
        assert problem is not None and "'pattern' rule is broken" in problem
        assert answer_problem(response_format, '"' + "a" * 40 + '"') is None

    def test_pattern_properties_run_in_re2_too(self) -> None:
        response_format = {
            "type": "json_schema",
            "schema": {"type": "object", "patternProperties": {REDOS: {"type": "integer"}}},
        }
        assert answer_problem(response_format, '{"' + "a" * 40 + '": 1}') is None
        assert "rule is broken" in (answer_problem(response_format, '{"' + "a" * 40 + '": "x"}') or "")

    def test_a_tool_calls_arguments_are_checked_in_re2(self) -> None:
        spec = tools_spec(
            tools=[
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {
                            "type": "object",
                            "properties": {"x": {"type": "string", "pattern": REDOS}},
                            "required": ["x"],
                        },
                    },
                }
            ],
            tool_choice=None,
            parallel=None,
        )
        made = tool_calls_in(
            spec, '{"tool_calls": [{"name": "f", "arguments": {"x": "' + "a" * 40 + '!"}}]}', request_id="r"
        )
        assert made is None  # not a valid call: the answer stays text
        made = tool_calls_in(
            spec, '{"tool_calls": [{"name": "f", "arguments": {"x": "' + "a" * 40 + '"}}]}', request_id="r"
        )
        assert made is not None and made[0]["function"]["name"] == "f"

    def test_re2_compiles_each_pattern_once(self) -> None:
        schema_limits.linear_pattern.cache_clear()
        response_format = {"type": "json_schema", "schema": {"type": "string", "pattern": "^b+$"}}
        for _ in range(5):
            answer_problem(response_format, '"bbb"')
        assert schema_limits.linear_pattern.cache_info().misses == 1


class ConverterHangTests:
    """llama-cpp-python's converter loops forever on patterns RE2 accepts (`^}$`, any literal `]`
    or `}` outside a class): the gateway converts in a child process with a time bound."""

    @pytest.mark.django_db(transaction=True)
    def test_a_pattern_that_hangs_the_converter_is_a_400_in_bounded_time(self, customer, settings) -> None:
        settings.GRAMMAR_CHECK_SECONDS = 0.5
        grammar_check._CHECKER._verdicts.clear()
        error = assert_error(
            post(Client(), customer.secret, chat({"type": "string", "pattern": "^}$"})), 400, "invalid_value"
        )
        assert "within 0.5 s" in error["message"]
        child = grammar_check._CHECKER._child
        assert child is None, "the stuck child was killed"
        again = assert_error(
            post(Client(), customer.secret, chat({"type": "string", "pattern": "^}$"})), 400, "invalid_value"
        )
        assert again["message"] == error["message"] and grammar_check._CHECKER._child is None, "answered from the cache"
        assert schema_problem({"type": "string", "pattern": "^[a-c]+$"}) is None, "a new child converts the next schema"
        assert grammar_check._CHECKER._child is not None and grammar_check._CHECKER._child.is_alive()

    @pytest.mark.django_db(transaction=True)
    def test_a_checker_that_cannot_start_is_a_503_in_the_api_format(self, customer, monkeypatch) -> None:
        grammar_check._CHECKER._stop()
        grammar_check._CHECKER._verdicts.clear()
        monkeypatch.setattr(grammar_check._CHECKER, "start_seconds", 0.0)  # (it never says "ready" in no time)
        error = assert_error(
            post(Client(), customer.secret, chat({"type": "string", "pattern": "^[a-d]+$"})),
            503,
            "grammar_check_unavailable",
        )
        assert "try again" in error["message"] and not Request.objects.exists()
