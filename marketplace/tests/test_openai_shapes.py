"""OpenAI's shapes where its clients read them (issue 50): a chat message's `refusal` is
present and null; with `stream_options.include_usage` the usage comes on a last chunk with no
choices and every other chunk says `"usage": null`; a required (or named) tool call cut by
max_tokens is a tool call with its arguments as far as they were written and finish_reason
"length", whole and streamed, never the half-written call as content."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import TYPE_CHECKING

import pytest
from django.utils import timezone

from marketplace.models import Request
from marketplace.openai.choices import Admitted, stream_chunks
from marketplace.openai.render import failed_choice, response_body
from marketplace.openai.responses import echoed, response_from_chat
from marketplace.openai.streaming import Ended, Text
from marketplace.openai.tool_calls import CallStream, call_id, tool_calls_in, tools_spec
from marketplace.tests.test_e2e import served  # noqa: F401  (the fixture)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
    {"type": "function", "function": {"name": "get_time", "parameters": CITY}},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
USAGE = {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12, "prompt_tokens_details": {"cached_tokens": 0}}


def ended_row(
    *, finish: str = "stop", tools: list | None = None, choice: object = None, kind: str = "chat"
) -> SimpleNamespace:
    """A request as it ends: what the renderers and the chunk stream read of its row."""
    spec = tools_spec(tools=tools, tool_choice=choice, parallel=None) if tools else None
    return SimpleNamespace(
        public_id="chatcmpl-shape",
        kind=kind,
        created_at=timezone.now(),
        model=SimpleNamespace(name="gemma-3-270m"),
        params={"tools": spec},
        resumed=False,
        status=Request.Status.COMPLETED,
        finish_reason=finish,
        prompt_tokens=9,
        cached_tokens=0,
        completion_tokens=3,
    )


class Replayed(Admitted):
    """A choice whose listener replays `texts` then ends with its row (no database)."""

    def __init__(self, row: SimpleNamespace, texts: list[str], *, include_usage: bool, index: int = 0) -> None:
        async def events() -> AsyncIterator[Text | Ended]:
            for text in texts:
                yield Text(text)
            yield Ended(row)  # type: ignore[arg-type]

        super().__init__(
            row=row,
            listener=SimpleNamespace(events=events, sent=0, model=None),
            include_usage=include_usage,  # type: ignore[arg-type]
            index=index,
        )

    async def close(self) -> None:
        return None


def streamed(choices: list[Admitted]) -> list[dict | str]:
    async def collect() -> list[dict | str]:
        return [chunk async for chunk in stream_chunks(choices)]

    return asyncio.run(collect())


class RefusalTests:
    def test_a_chat_message_says_refusal_null_beside_text_calls_and_a_failed_choice(self) -> None:
        row = ended_row()
        assert response_body(row, text="Hi")["choices"][0]["message"] == {
            "role": "assistant",
            "content": "Hi",
            "refusal": None,
        }
        call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"city":"Rome"}'}}
        assert response_body(ended_row(finish="stop"), text="", calls=[call])["choices"][0]["message"] == {
            "role": "assistant",
            "content": None,
            "refusal": None,
            "tool_calls": [call],
        }
        assert failed_choice(row, index=1)["message"] == {"role": "assistant", "content": None, "refusal": None}

    def test_the_first_chunk_of_a_stream_says_refusal_null(self) -> None:
        chunks = streamed([Replayed(ended_row(), ["Hi"], include_usage=False)])
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "", "refusal": None}  # type: ignore[index]

    def test_the_schema_documents_it(self) -> None:
        from marketplace.openai.outputs import AssistantMessageSerializer

        assert AssistantMessageSerializer().fields["refusal"].allow_null


class UsageChunkTests:
    def test_with_include_usage_the_usage_comes_last_on_a_chunk_with_no_choices_and_every_other_says_null(self) -> None:
        chunks = streamed([Replayed(ended_row(), ["Hel", "lo"], include_usage=True)])
        assert chunks[-1] == "[DONE]"
        *bodies, last = [chunk for chunk in chunks if isinstance(chunk, dict)]
        assert last["choices"] == [] and last["usage"] == USAGE and last["object"] == "chat.completion.chunk"
        assert last["id"] == "chatcmpl-shape"
        assert all(body["usage"] is None for body in bodies), bodies
        assert bodies[-1]["choices"][0]["finish_reason"] == "stop"  # the finish chunk carries no usage
        assert "".join(body["choices"][0]["delta"].get("content", "") for body in bodies) == "Hello"

    def test_without_it_no_chunk_has_usage(self) -> None:
        chunks = streamed([Replayed(ended_row(), ["Hello"], include_usage=False)])
        bodies = [chunk for chunk in chunks if isinstance(chunk, dict)]
        assert all("usage" not in body for body in bodies) and all(body["choices"] for body in bodies)

    def test_a_text_completion_stream_ends_the_same_way(self) -> None:
        chunks = streamed([Replayed(ended_row(kind="completion"), ["Once"], include_usage=True)])
        *bodies, last = [chunk for chunk in chunks if isinstance(chunk, dict)]
        assert last == {
            "id": "chatcmpl-shape",
            "object": "text_completion",
            "created": last["created"],
            "model": "gemma-3-270m",
            "choices": [],
            "usage": USAGE,
        }
        assert all(body["usage"] is None for body in bodies)

    def test_several_choices_share_one_usage_chunk_and_the_others_say_null(self) -> None:
        rows = [ended_row(), ended_row()]
        chunks = streamed([Replayed(row, ["Hi"], include_usage=True, index=at) for at, row in enumerate(rows)])
        *bodies, last = [chunk for chunk in chunks if isinstance(chunk, dict)]
        assert last["choices"] == [] and last["usage"] == {
            "prompt_tokens": 9,
            "completion_tokens": 6,
            "total_tokens": 15,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        assert all(body["usage"] is None for body in bodies)
        assert sorted(
            body["choices"][0]["finish_reason"] for body in bodies if body["choices"][0]["finish_reason"]
        ) == ["stop", "stop"]

    def test_the_responses_door_reads_the_usage_from_that_last_chunk(self) -> None:
        from marketplace.tests.test_responses import chunk, events_of, fake_admitted

        events = events_of(
            fake_admitted(
                [
                    chunk("Hi", usage=None),
                    chunk(finish="stop", usage=None),
                    {"id": "resp_ab12", "choices": [], "usage": USAGE},
                    "[DONE]",
                ]
            )
        )
        assert events[-1]["type"] == "response.completed" and events[-1]["response"]["usage"]["input_tokens"] == 9
        assert events[-1]["response"]["usage"]["output_tokens"] == 3


class CutToolCallTests:
    """Under a required call the host samples under the call's grammar: whatever max_tokens
    cuts is the start of a call."""

    def spec(self, choice: object = "required") -> dict:
        spec = tools_spec(tools=TOOLS, tool_choice=choice, parallel=None)
        assert spec is not None
        return spec

    def test_a_required_call_cut_in_its_arguments_is_that_call_with_the_arguments_written_so_far(self) -> None:
        cut = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Par'
        assert tool_calls_in(self.spec(), cut, request_id="chatcmpl-1", cut=True) == [
            {
                "id": call_id("chatcmpl-1", 0),
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Par'},
            }
        ]

    def test_calls_completed_before_the_cut_come_first(self) -> None:
        cut = (
            '{"tool_calls": [{"name": "get_time", "arguments": {"city": '
            '"Rome"}}, {"name": "get_weather", "arguments": {"ci'
        )
        calls = tool_calls_in(self.spec(), cut, request_id="x", cut=True)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            ("get_time", '{"city": "Rome"}'),
            ("get_weather", '{"ci'),
        ]

    def test_a_cut_before_the_name_is_whole_names_the_one_function_it_can_be(self) -> None:
        named = self.spec(NAMED)
        for cut in ("{", '{"tool_calls": [{"name": "get_w', '{"tool_calls": [{"na'):
            assert tool_calls_in(named, cut, request_id="x", cut=True) == [
                {"id": call_id("x", 0), "type": "function", "function": {"name": "get_weather", "arguments": ""}}
            ], cut
        assert [
            c["function"]["name"]
            for c in tool_calls_in(self.spec(), '{"tool_calls": [{"name": "get_t', request_id="x", cut=True)
        ] == ["get_time"]
        assert tool_calls_in(self.spec(), '{"tool_calls": [{"name": "get_', request_id="x", cut=True) == [], (
            "two functions begin so: no call is known, and the text is no content either"
        )

    def test_the_whole_answer_is_a_tool_call_finishing_length_never_content(self) -> None:
        cut = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Par'
        row = ended_row(finish="length", tools=TOOLS, choice="required")
        body = response_body(
            row, text=cut, calls=tool_calls_in(row.params["tools"], cut, request_id=row.public_id, cut=True)
        )
        assert body["choices"][0] == {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": None,
                "refusal": None,
                "tool_calls": [
                    {
                        "id": call_id(row.public_id, 0),
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Par'},
                    }
                ],
            },
            "logprobs": None,
            "finish_reason": "length",
        }
        nothing = response_body(row, text='{"tool_calls": [{"name": "get_', calls=[])
        assert nothing["choices"][0]["message"] == {"role": "assistant", "content": None, "refusal": None}

    def test_auto_keeps_only_the_calls_it_completed(self) -> None:
        cut = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Par'
        assert tool_calls_in(self.spec("auto"), cut, request_id="x", cut=True) is None  # no grammar held it to a call

    def test_the_responses_door_hands_it_over_as_an_incomplete_function_call(self) -> None:
        cut = (
            '{"tool_calls": [{"name": "get_time", "arguments": {"city": '
            '"Rome"}}, {"name": "get_weather", "arguments": {"ci'
        )
        row = ended_row(finish="length", tools=TOOLS, choice="required")
        row.public_id = "resp_ab12"
        chat = response_body(
            row, text=cut, calls=tool_calls_in(row.params["tools"], cut, request_id=row.public_id, cut=True)
        )
        response = response_from_chat(chat, params={}, echo=echoed({}))
        assert response["status"] == "incomplete"
        assert [(item["type"], item["name"], item["status"], item["arguments"]) for item in response["output"]] == [
            ("function_call", "get_time", "completed", '{"city": "Rome"}'),
            ("function_call", "get_weather", "incomplete", '{"ci'),
        ]

    def test_a_stream_cut_in_the_arguments_sent_them_as_a_call_and_finishes_length(self) -> None:
        cut = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Par'
        row = ended_row(finish="length", tools=TOOLS, choice="required")
        chunks = streamed([Replayed(row, [cut[:20], cut[20:]], include_usage=False)])
        bodies = [chunk["choices"][0] for chunk in chunks if isinstance(chunk, dict)]
        assert not any(body["delta"].get("content") for body in bodies), "nothing of the call is content"
        calls = [call for body in bodies for call in body["delta"].get("tool_calls") or []]
        assert calls[0] == {
            "index": 0,
            "id": call_id(row.public_id, 0),
            "type": "function",
            "function": {"name": "get_weather", "arguments": ""},
        }
        assert "".join(call["function"]["arguments"] for call in calls) == '{"city": "Par'
        assert bodies[-1]["finish_reason"] == "length"

    def test_a_stream_cut_inside_the_name_sends_the_named_call_at_the_end(self) -> None:
        row = ended_row(finish="length", tools=TOOLS, choice=NAMED)
        chunks = streamed([Replayed(row, ['{"tool_calls": [{"name": "get_we'], include_usage=False)])
        bodies = [chunk["choices"][0] for chunk in chunks if isinstance(chunk, dict)]
        assert not any(body["delta"].get("content") for body in bodies)
        assert [call for body in bodies for call in body["delta"].get("tool_calls") or []] == [
            {
                "index": 0,
                "id": call_id(row.public_id, 0),
                "type": "function",
                "function": {"name": "get_weather", "arguments": ""},
            }
        ]
        assert bodies[-1]["finish_reason"] == "length"

    def test_a_required_stream_cut_before_any_name_is_known_relays_no_content(self) -> None:
        stream = CallStream(self.spec(), request_id="x")
        assert stream.feed('{"tool_calls": [{"name": "get_') == ("", [], [])
        assert stream.finish(cut=True) == ("", [], [], [])

    def test_a_whole_required_call_is_unchanged(self) -> None:
        whole = json.dumps({"tool_calls": [{"name": "get_time", "arguments": {"city": "Rome"}}]})
        stream = CallStream(self.spec(), request_id="x")
        _, _, deltas = stream.feed(whole)
        _, _, more, calls = stream.finish()
        assert [c["function"]["name"] for c in calls] == ["get_time"] and more == []
        assert "".join(d["function"]["arguments"] for d in deltas) == '{"city": "Rome"}'


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
class RealClientTests:
    """The same through a real gateway and the shipped model, read raw and by the `openai` package."""

    def test_a_named_call_cut_by_max_tokens_and_the_usage_chunk_as_openais_clients_read_them(
        self, gateway, served  # noqa: F811
    ) -> None:  # noqa: ANN001, F811
        import httpx

        from marketplace.tests.test_e2e import client

        customer = served[0]
        ask = {
            "model": "gemma-3-270m",
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": TOOLS,
            "tool_choice": NAMED,
            "max_tokens": 12,
            "temperature": 0,
        }
        headers = {"Authorization": f"Bearer {customer.secret}"}
        whole = httpx.post(f"{gateway.url}/v1/chat/completions", json=ask, headers=headers, timeout=120).json()
        choice = whole["choices"][0]
        assert choice["finish_reason"] == "length" and choice["message"]["content"] is None, whole
        assert choice["message"]["refusal"] is None and set(choice["message"]) == {
            "role",
            "content",
            "refusal",
            "tool_calls",
        }
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather" and call["function"]["arguments"][:1] in (
            "",
            "{",
        )  # as far as written

        lines: list[dict] = []
        with httpx.stream(
            "POST",
            f"{gateway.url}/v1/chat/completions",
            headers=headers,
            timeout=120,
            json={**ask, "stream": True, "stream_options": {"include_usage": True}},
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    lines.append(json.loads(line[6:]))
        *chunks, last = lines
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 12
        assert all(chunk["usage"] is None for chunk in chunks) and chunks[-1]["choices"][0]["finish_reason"] == "length"
        deltas = [d for chunk in chunks for d in chunk["choices"][0]["delta"].get("tool_calls") or []]
        assert not any(chunk["choices"][0]["delta"].get("content") for chunk in chunks)
        assert (
            deltas[0]["function"]["name"] == "get_weather"
            and "".join(d["function"].get("arguments", "") for d in deltas) == call["function"]["arguments"]
        ), "greedy: as the whole one"

        api = client(gateway, customer)
        parsed = api.chat.completions.create(**ask)  # type: ignore[call-overload]
        assert (
            parsed.choices[0].message.refusal is None
            and parsed.choices[0].message.tool_calls[0].function.name == "get_weather"
        )
        streamed = list(api.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))  # type: ignore[call-overload]
        assert (
            streamed[-1].choices == [] and streamed[-1].usage is not None and streamed[-1].usage.completion_tokens == 12
        )
