"""Function tools and `text.format` on /v1/responses, and tool-call arguments streamed as they
are generated in both APIs (issue 34): the body translated into the chat's tools,
`tool_choice`, call turns and `response_format`; the chat's call deltas translated into
function_call items and their events; the scanner that finds a call's arguments in a growing
answer; every refusal a 400 in OpenAI's shape naming the field. Through the `openai` package
against a real gateway and host: test_responses_tools_e2e.py."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest
from django.test import Client

from marketplace.models import Request
from marketplace.openai.responses import chat_body, echoed, response_from_chat
from marketplace.openai.tool_calls import CallScanner, CallStream, tool_calls_in, tools_spec
from marketplace.tests.test_apis import assert_error, post
from marketplace.tests.test_responses import events_of, fake_admitted

if TYPE_CHECKING:
    from django.test.client import _MonkeyPatchedWSGIResponse as TestResponse

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": WEATHER,
    "strict": True,
}
CHAT_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER, "strict": True},
}
GOOD = {"model": "gemma-3-270m", "input": "What is the weather in Paris?", "max_output_tokens": 40, "tools": [TOOL]}
CALL = {
    "type": "function_call",
    "call_id": "call_1",
    "name": "get_weather",
    "arguments": '{"city": "Paris"}',
    "id": "fc_1",
    "status": "completed",
}
OUTPUT = {"type": "function_call_output", "call_id": "call_1", "output": "18 C, sunny"}
ANSWER = (
    '{"tool_calls": [{"name": "get_weather", "arguments": {"city": '
    '"Paris"}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]}'
)


def respond(secret: str | None, body: object) -> TestResponse:
    return post(Client(), secret, body, path="/v1/responses")


class TranslationTests:
    def test_function_tools_and_choices_become_the_chats(self) -> None:
        chat = chat_body(
            {**GOOD, "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False}
        )
        assert chat["tools"] == [CHAT_TOOL] and chat["parallel_tool_calls"] is False
        assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
        assert chat_body({**GOOD, "tool_choice": "required"})["tool_choice"] == "required"
        bare = chat_body({**GOOD, "tools": [{"type": "function", "name": "now"}]})
        assert bare["tools"] == [{"type": "function", "function": {"name": "now"}}] and "tool_choice" not in bare

    def test_allowed_tools_offers_only_those_it_lists(self) -> None:
        other = {**TOOL, "name": "get_time"}
        chat = chat_body(
            {
                **GOOD,
                "tools": [TOOL, other],
                "tool_choice": {
                    "type": "allowed_tools",
                    "mode": "required",
                    "tools": [{"type": "function", "name": "get_time"}],
                },
            }
        )
        assert [tool["function"]["name"] for tool in chat["tools"]] == ["get_time"] and chat[
            "tool_choice"
        ] == "required"

    def test_calls_and_their_outputs_become_assistant_tool_calls_and_tool_turns(self) -> None:
        second = {**CALL, "call_id": "call_2", "arguments": '{"city": "Oslo"}'}
        chat = chat_body(
            {
                **GOOD,
                "input": [
                    {"role": "user", "content": "Weather in Paris and Oslo?"},
                    {
                        "type": "message",
                        "role": "assistant",
                        "content": [{"type": "output_text", "text": "Looking.", "annotations": []}],
                    },
                    CALL,
                    second,
                    OUTPUT,
                    {**OUTPUT, "call_id": "call_2", "output": [{"type": "input_text", "text": "9 C"}]},
                ],
            }
        )
        assert chat["messages"] == [
            {"role": "user", "content": "Weather in Paris and Oslo?"},
            {
                "role": "assistant",
                "content": "Looking.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    },
                    {
                        "id": "call_2",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
            {"role": "tool", "tool_call_id": "call_2", "content": "9 C"},
        ]

    def test_text_formats_become_the_chats_response_format(self) -> None:
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        chat = chat_body(
            {**GOOD, "text": {"format": {"type": "json_schema", "name": "count", "schema": schema, "strict": True}}}
        )
        assert chat["response_format"] == {
            "type": "json_schema",
            "json_schema": {"name": "count", "schema": schema, "strict": True},
        }
        assert chat_body({**GOOD, "text": {"format": {"type": "json_object"}}})["response_format"] == {
            "type": "json_object"
        }
        assert "response_format" not in chat_body({**GOOD, "text": {"format": {"type": "text"}, "verbosity": "medium"}})
        echo = echoed({**GOOD, "text": {"format": {"type": "json_schema", "name": "count", "schema": schema}}})
        assert echo["text"] == {"format": {"type": "json_schema", "name": "count", "schema": schema}}
        assert echo["tools"] == [TOOL] and echo["tool_choice"] == "auto" and echo["parallel_tool_calls"] is True

    def test_a_whole_answer_with_calls_becomes_function_call_items(self) -> None:
        calls = tool_calls_in(
            tools_spec(tools=[CHAT_TOOL], tool_choice="required", parallel=None), ANSWER, request_id="resp_ab"
        )
        chat = {
            "id": "resp_ab",
            "created": 1,
            "model": "gemma-3-270m",
            "usage": {"prompt_tokens": 9, "completion_tokens": 30},
            "choices": [
                {"message": {"role": "assistant", "content": None, "tool_calls": calls}, "finish_reason": "tool_calls"}
            ],
        }
        body = response_from_chat(chat, params={}, echo=echoed(GOOD))
        assert body["status"] == "completed" and [item["type"] for item in body["output"]] == ["function_call"] * 2
        first = body["output"][0]
        assert first == {
            "id": "fc_" + calls[0]["id"].removeprefix("call_"),
            "type": "function_call",
            "status": "completed",
            "call_id": calls[0]["id"],
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        }
        assert body["tools"] == [TOOL]


def call_chunk(call: dict, finish: str | None = None, **extra: object) -> dict:
    return {
        "id": "resp_ab12",
        "choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": finish}],
        **extra,
    }


def finish_chunk(reason: str) -> dict:
    usage = {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21}
    return {"id": "resp_ab12", "choices": [{"index": 0, "delta": {}, "finish_reason": reason}], "usage": usage}


def with_tools(admitted: object) -> object:
    admitted.row.params["tools"] = {"choice": "required"}  # type: ignore[attr-defined]
    return admitted


class StreamEventTests:
    def test_calls_stream_as_function_call_items_with_their_arguments_piece_by_piece(self) -> None:
        named = {"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
        pieces = ['{"ci', 'ty": "Pa', 'ris"}']
        second = {"index": 1, "id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
        chunks = [
            {
                "id": "resp_ab12",
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
            },
            call_chunk(named),
            *(call_chunk({"index": 0, "function": {"arguments": p}}) for p in pieces),
            call_chunk(second),
            call_chunk({"index": 1, "function": {"arguments": "{}"}}),
            finish_chunk("tool_calls"),
            "[DONE]",
        ]
        events = events_of(with_tools(fake_admitted(chunks)))
        assert [e["type"] for e in events] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            *["response.function_call_arguments.delta"] * 3,
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        added = events[2]["item"]
        assert added == {
            "id": "fc_a",
            "type": "function_call",
            "status": "in_progress",
            "call_id": "call_a",
            "name": "get_weather",
            "arguments": "",
        }
        assert [e["delta"] for e in events[3:6]] == pieces and all(e["item_id"] == "fc_a" for e in events[3:7])
        assert events[6]["arguments"] == '{"city": "Paris"}' and events[6]["name"] == "get_weather"
        assert events[7]["item"] == {**added, "status": "completed", "arguments": '{"city": "Paris"}'}
        assert events[8]["output_index"] == 1 and events[8]["item"]["call_id"] == "call_b"
        final = events[-1]["response"]
        assert final["status"] == "completed" and [item["call_id"] for item in final["output"]] == ["call_a", "call_b"]
        assert final["usage"]["output_tokens"] == 12

    def test_with_tools_text_opens_the_message_when_it_comes_and_a_cut_call_is_incomplete(self) -> None:
        events = events_of(
            with_tools(
                fake_admitted(
                    [
                        {
                            "id": "resp_ab12",
                            "choices": [{"index": 0, "delta": {"content": "Sunny."}, "finish_reason": None}],
                        },
                        finish_chunk("stop"),
                    ]
                )
            )
        )
        assert [e["type"] for e in events][2:5] == [
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
        ]
        assert events[-1]["response"]["output"][0]["content"][0]["text"] == "Sunny."
        named = {"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
        cut = events_of(
            with_tools(
                fake_admitted(
                    [
                        call_chunk(named),
                        call_chunk({"index": 0, "function": {"arguments": '{"ci'}}),
                        finish_chunk("length"),
                    ]
                )
            )
        )
        assert cut[-1]["type"] == "response.incomplete"
        assert cut[-2]["item"]["status"] == "incomplete" and cut[-2]["item"]["arguments"] == '{"ci'

    def test_an_empty_answer_with_tools_is_an_empty_message(self) -> None:
        events = events_of(with_tools(fake_admitted([finish_chunk("stop")])))
        assert events[-1]["response"]["output"][0]["type"] == "message"
        assert events[-1]["response"]["output"][0]["content"][0]["text"] == ""


class ScannerTests:
    def test_it_finds_each_calls_name_and_arguments_as_the_answer_grows_a_character_at_a_time(self) -> None:
        scanner = CallScanner()
        seen = []
        for char in ANSWER:
            scanner.feed(char)
            seen.append(tuple((c.name, scanner.arguments_so_far(i)) for i, c in enumerate(scanner.calls)))
        assert not scanner.broken
        assert [scanner.arguments(i) for i in range(2)] == ['{"city": "Paris"}', '{"city": "Oslo"}']
        assert [c.name for c in scanner.calls] == ["get_weather"] * 2
        firsts = [s for s in seen if s and s[0][1]]
        assert firsts[0] == (("get_weather", "{"),), "the arguments begin once their first character is read"

    @pytest.mark.parametrize(
        "answer",
        [
            '{"tool_calls":[{"name":"f","arguments":{"s":"a \\" } ] \\\\","n":[1,-2.5e3,true,null]}}]}',
            '{ "tool_calls" : [ { "name" : "f" , "arguments" : { } } ] }',
            '\n{"tool_calls": [{"name": "f", "arguments": 42}]}',
            '{"tool_calls": [{"arguments": {"x": 1}, "name": "f"}]}',
        ],
    )
    def test_arguments_are_the_exact_text_written_whatever_is_inside_them(self, answer: str) -> None:
        scanner = CallScanner()
        for at in range(0, len(answer), 3):
            scanner.feed(answer[at : at + 3])
        expected = json.loads(answer)["tool_calls"][0]["arguments"]
        assert not scanner.broken and json.loads(scanner.arguments(0)) == expected  # type: ignore[arg-type]
        assert scanner.calls[0].name == "f"

    @pytest.mark.parametrize("answer", ['{"tool_calls": [}', '{"a": 1} {', '{"tool_calls": [{"name" 1}]}', "Sunny"])
    def test_text_json_does_not_allow_stops_it(self, answer: str) -> None:
        scanner = CallScanner()
        scanner.feed(answer)
        assert scanner.broken


def stream_of(spec: dict, pieces: list[str], *, cut: bool = False) -> tuple[list[dict], list[dict] | None, str]:
    """Feed `pieces` to a CallStream: (every delta sent, the calls at the end, the content)."""
    stream = CallStream(spec, request_id="chatcmpl-x")
    deltas, content = [], ""
    for piece in pieces:
        text, _, made = stream.feed(piece)
        content += text
        deltas += made
    held, _, made, calls = stream.finish(cut=cut)
    return deltas + made, calls, content + held


def joined(deltas: list[dict]) -> dict[int, dict]:
    """The calls the deltas add up to, as a client accumulates them."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        call = calls.setdefault(delta["index"], {"id": None, "name": "", "arguments": ""})
        call["id"] = call["id"] or delta.get("id")
        call["name"] += delta["function"].get("name") or ""
        call["arguments"] += delta["function"]["arguments"]
    return calls


class CallStreamTests:
    spec = tools_spec(tools=[CHAT_TOOL], tool_choice="required", parallel=None)

    def test_a_required_call_streams_its_arguments_as_they_arrive_and_they_add_up_to_the_call(self) -> None:
        pieces = [ANSWER[at : at + 4] for at in range(0, len(ANSWER), 4)]
        deltas, calls, content = stream_of(self.spec, pieces)
        assert content == "" and calls is not None
        assert deltas[0] == {
            "index": 0,
            "id": calls[0]["id"],
            "type": "function",
            "function": {"name": "get_weather", "arguments": ""},
        }, "the first delta names the call"
        assert len([d for d in deltas if d["index"] == 0]) > 3, "arguments in several pieces, not one"
        assert joined(deltas) == {
            i: {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for i, c in enumerate(calls)
        }

    def test_each_character_goes_out_once_however_the_text_is_cut(self) -> None:
        for size in (1, 2, 7, len(ANSWER)):
            pieces = [ANSWER[at : at + size] for at in range(0, len(ANSWER), size)]
            deltas, calls, _ = stream_of(self.spec, pieces)
            assert [c["arguments"] for c in joined(deltas).values()] == ['{"city": "Paris"}', '{"city": "Oslo"}'], size
            assert [c["function"]["arguments"] for c in calls or []] == ['{"city": "Paris"}', '{"city": "Oslo"}']

    def test_a_resumed_stream_sends_only_what_comes_after_the_text_its_customer_has(self) -> None:
        whole, _, _ = stream_of(self.spec, [ANSWER])
        for at in (5, 40, 60, len(ANSWER) - 3):
            early = CallStream(self.spec, request_id="chatcmpl-x").feed(ANSWER[:at])[2]
            later = CallStream(self.spec, request_id="chatcmpl-x")
            later.prime(ANSWER[:at])
            rest = later.feed(ANSWER[at:])[2] + later.finish()[2]
            assert joined(early + rest) == joined(whole), at

    def test_a_cut_answer_keeps_the_call_it_was_writing_in_the_stream(self) -> None:
        cut = ANSWER.index("Oslo") + 2
        deltas, calls, _ = stream_of(self.spec, [ANSWER[:cut]], cut=True)
        assert [c["function"]["arguments"] for c in calls or []] == ['{"city": "Paris"}', '{"city": "Os']
        assert joined(deltas)[1]["arguments"] == '{"city": "Os', "the call it was writing went out as far as it got"

    def test_under_auto_prose_is_content_and_a_call_goes_out_whole_at_the_end(self) -> None:
        auto = tools_spec(tools=[CHAT_TOOL], tool_choice="auto", parallel=None)
        deltas, calls, content = stream_of(auto, [ANSWER[:20], ANSWER[20:]])
        assert content == "" and calls and len(deltas) == 4 and joined(deltas)[0]["arguments"] == '{"city": "Paris"}'
        deltas, calls, content = stream_of(auto, ['{"tool', '_calls": "no"}'])
        assert calls is None and deltas == [] and content == '{"tool_calls": "no"}', "not a call: content after all"


@pytest.mark.django_db(transaction=True)
class RefusalTests:
    @pytest.mark.parametrize(
        ("body", "param"),
        [
            ({**GOOD, "tools": [{"type": "banana", "name": "f"}]}, "tools[0].type"),
            ({**GOOD, "tools": [{"type": "function"}]}, "tools[0].name"),
            ({**GOOD, "tools": [{"type": "function", "name": "has space"}]}, "tools[0].name"),
            ({**GOOD, "tools": [{"type": "function", "name": "f", "parameters": "x"}]}, "tools[0].parameters"),
            ({**GOOD, "tools": [TOOL, TOOL]}, "tools"),
            ({**GOOD, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
            (
                {
                    **GOOD,
                    "tool_choice": {
                        "type": "allowed_tools",
                        "mode": "auto",
                        "tools": [{"type": "function", "name": "x"}],
                    },
                },
                "tool_choice",
            ),
            ({**GOOD, "tools": None, "tool_choice": "required"}, "tool_choice"),
            ({**GOOD, "tool_choice": "sometimes"}, "tool_choice"),
            ({**GOOD, "input": [{"role": "user", "content": "hi"}, OUTPUT]}, "input[1].call_id"),
            ({**GOOD, "input": [{"role": "user", "content": "hi"}, {**CALL, "arguments": None}]}, "input[1].arguments"),
            ({**GOOD, "input": [{"role": "user", "content": "hi"}, CALL, {**OUTPUT, "output": 5}]}, "input[2].output"),
            ({**GOOD, "text": {"format": {"type": "xml"}}}, "text.format.type"),
            ({**GOOD, "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
            ({**GOOD, "text": {"format": {"type": "json_schema", "name": "x", "schema": 5}}}, "text.format.schema"),
            ({**GOOD, "text": {"form": {}}}, "text.form"),
            ({**GOOD, "parallel_tool_calls": "maybe"}, "parallel_tool_calls"),
        ],
    )
    def test_bad_tools_calls_and_formats_are_400s_naming_the_field(self, customer, body, param) -> None:  # noqa: ANN001
        error = assert_error(respond(customer.secret, body), 400, "invalid_value")
        assert error["param"] == param and error["type"] == "invalid_request_error", error
        assert not Request.objects.exists()

    def test_a_schema_no_grammar_can_follow_is_a_400_naming_text_format(self, customer) -> None:  # noqa: ANN001
        bad = {"type": "object", "properties": {"n": {"type": "integer", "minimum": "zero"}}}
        error = assert_error(
            respond(customer.secret, {**GOOD, "text": {"format": {"type": "json_schema", "name": "n", "schema": bad}}}),
            400,
            "invalid_value",
        )
        assert (
            error["param"] == "text.format"
            and "'text.format': its schema is not a usable JSON Schema" in error["message"]
        )
        error = assert_error(
            respond(customer.secret, {**GOOD, "tools": [{**TOOL, "parameters": bad}]}), 400, "invalid_value"
        )
        assert error["param"] == "tools"
        assert not Request.objects.exists()

    @pytest.mark.parametrize(
        ("body", "param"),
        [
            ({**GOOD, "tools": [{"type": "web_search"}]}, "tools[0].type"),
            ({**GOOD, "tools": [TOOL, {"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[1].type"),
            ({**GOOD, "tools": [{"type": "mcp", "server_label": "x"}]}, "tools[0].type"),
            ({**GOOD, "tool_choice": {"type": "file_search"}}, "tool_choice"),
            ({**GOOD, "input": [{"type": "item_reference", "id": "fc_1"}]}, "input[0].type"),
        ],
    )
    def test_built_in_tools_and_stored_state_are_refused_as_not_offered(self, customer, body, param) -> None:  # noqa: ANN001
        error = assert_error(respond(customer.secret, body), 400, "unsupported_parameter")
        assert error["param"] == param
        assert not Request.objects.exists()
