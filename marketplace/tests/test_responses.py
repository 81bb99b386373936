"""OpenAI's Responses API (issue 34): the body translated into a chat, the chat's
answer translated into a Response object and its semantic events, every refusal a 400 in
OpenAI's shape naming the parameter; and GET /v1/models/{id}. The same through the `openai`
package against a real gateway and host: test_responses_e2e.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import TYPE_CHECKING

import pytest
from django.test import Client

from billing.models import Hold
from core.errors import DomainError
from marketplace.models import Job, Request
from marketplace.openai.responses import chat_body, echoed, response_events, response_from_chat
from marketplace.tests.test_apis import assert_error, post
from marketplace.tests.test_model_list import listed, serve

if TYPE_CHECKING:
    from django.test.client import _MonkeyPatchedWSGIResponse as TestResponse

pytestmark = pytest.mark.django_db(
    transaction=True
)  # the API views are async: their database threads must see the rows

GOOD = {"model": "gemma-3-270m", "input": "Say hi", "max_output_tokens": 8}


def respond(secret: str | None, body: object) -> TestResponse:
    return post(Client(), secret, body, path="/v1/responses")


class TranslationTests:
    def test_a_string_input_is_one_user_turn_and_the_limits_are_the_chats(self) -> None:
        assert chat_body({**GOOD, "temperature": 0.2, "top_p": 0.9}) == {
            "model": "gemma-3-270m",
            "messages": [{"role": "user", "content": "Say hi"}],
            "stream": False,
            "max_tokens": 8,
            "temperature": 0.2,
            "top_p": 0.9,
        }

    def test_instructions_come_first_and_items_become_turns_with_their_parts_joined(self) -> None:
        body = {
            "model": "m",
            "instructions": "Be brief.",
            "stream": True,
            "input": [
                {"role": "developer", "content": "Answer in French."},
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Say "}, {"type": "input_text", "text": "hi"}],
                },
                {"role": "assistant", "content": [{"type": "output_text", "text": "Salut"}]},
                {"role": "user", "content": "Again"},
            ],
        }
        assert chat_body(body) == {
            "model": "m",
            "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "system", "content": "Answer in French."},
                {"role": "user", "content": "Say hi"},
                {"role": "assistant", "content": "Salut"},
                {"role": "user", "content": "Again"},
            ],
        }

    def test_values_that_change_nothing_pass(self) -> None:
        harmless: dict[str, object] = {
            "store": False,
            "previous_response_id": None,
            "tools": [],
            "tool_choice": "auto",
            "reasoning": {"effort": None},
            "text": {"format": {"type": "text"}},
            "include": [],
            "truncation": "disabled",
            "parallel_tool_calls": True,
            "metadata": {"team": "a"},
            "user": "u-42",
            "service_tier": "auto",
            "background": False,
        }
        assert chat_body({**GOOD, **harmless})["messages"] == [{"role": "user", "content": "Say hi"}]

    def test_a_whole_chat_becomes_a_response_object(self) -> None:
        chat = {
            "id": "resp_ab12",
            "object": "chat.completion",
            "created": 1700000000,
            "model": "gemma-3-270m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi there"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12},
        }
        body = response_from_chat(
            chat,
            params={"temperature": 0.5, "top_p": 1.0},
            echo=echoed({**GOOD, "instructions": "Be brief.", "metadata": {"k": "v"}}),
        )
        assert body["id"] == "resp_ab12" and body["object"] == "response" and body["status"] == "completed"
        assert body["created_at"] == 1700000000 and body["incomplete_details"] is None and body["error"] is None
        assert body["output"] == [
            {
                "id": "msg_ab12",
                "type": "message",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Hi there", "annotations": [], "logprobs": []}],
            }
        ]
        assert body["usage"] == {
            "input_tokens": 9,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 3,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 12,
        }
        assert (body["instructions"], body["metadata"], body["max_output_tokens"], body["temperature"]) == (
            "Be brief.",
            {"k": "v"},
            8,
            0.5,
        )
        assert body["store"] is False and body["tools"] == []

    def test_it_repeats_the_fields_as_validated(self) -> None:
        assert echoed({**GOOD, "user": 0, "metadata": {"n": 1}}) == {
            "instructions": None,
            "max_output_tokens": 8,
            "metadata": {"n": "1"},
            "user": "0",
            "tools": [],
            "tool_choice": "auto",
            "parallel_tool_calls": True,
            "text": {"format": {"type": "text"}},
            "store": False,
            "previous_response_id": None,
        }

    def test_an_answer_cut_by_max_output_tokens_is_incomplete_as_openai_says(self) -> None:
        chat = {
            "id": "resp_1",
            "created": 1,
            "model": "m",
            "usage": {"prompt_tokens": 1, "completion_tokens": 8, "total_tokens": 9},
            "choices": [{"message": {"content": "a b c"}, "finish_reason": "length"}],
        }
        body = response_from_chat(chat, params={}, echo=echoed({}))
        assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
        assert body["output"][0]["status"] == "incomplete"


def fake_admitted(chunks: list) -> SimpleNamespace:
    """An admitted chat whose stream of chat chunks is `chunks`."""

    async def stream() -> AsyncIterator:
        for chunk in chunks:
            yield chunk

    row = SimpleNamespace(
        public_id="resp_ab12",
        created_at=None,
        model=SimpleNamespace(name="gemma-3-270m"),
        params={"temperature": 0.0, "top_p": 1.0},
    )
    return SimpleNamespace(row=row, chunks=stream)


def chunk(content: str | None = None, finish: str | None = None, **extra: object) -> dict:
    delta = {} if content is None else {"content": content}
    return {"id": "resp_ab12", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}


def events_of(admitted: SimpleNamespace) -> list[dict]:
    async def collect() -> list[dict]:
        return [event async for event in response_events(admitted, echo=echoed({}))]  # type: ignore[arg-type]

    from unittest import mock

    with mock.patch("marketplace.openai.responses.unix", return_value=1700000000):
        return asyncio.run(collect())


class StreamEventTests:
    def test_it_sends_the_documented_events_in_order_and_the_deltas_join_to_the_text(self) -> None:
        usage = {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}
        events = events_of(
            fake_admitted(
                [
                    chunk(""),
                    chunk("Hi"),
                    chunk(" there"),
                    chunk(finish="stop", usage=None),
                    {"id": "resp_ab12", "choices": [], "usage": usage},
                    "[DONE]",
                ]
            )
        )  # (OpenAI's usage chunk)
        assert [e["type"] for e in events] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["id"] == "resp_ab12"
        assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == ["Hi", " there"]
        assert all(e["item_id"] == "msg_ab12" for e in events if "item_id" in e)
        assert events[6]["text"] == events[7]["part"]["text"] == events[8]["item"]["content"][0]["text"] == "Hi there"
        final = events[-1]["response"]
        assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == "Hi there"
        assert (
            final["usage"]["input_tokens"] == 9
            and final["usage"]["output_tokens"] == 2
            and final["usage"]["total_tokens"] == 11
        )

    def test_a_stream_cut_by_max_output_tokens_ends_incomplete_and_a_resumed_one_says_so(self) -> None:
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        events = events_of(
            fake_admitted([chunk("a"), chunk(finish="length", usage=usage, x_elephant={"resumed": True})])
        )
        assert events[-1]["type"] == "response.incomplete" and events[-1]["x_elephant"] == {"resumed": True}
        assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}

    def test_a_request_that_fails_mid_stream_ends_with_response_failed_and_its_error(self) -> None:
        error = {"error": {"message": "Both hosts failed.", "type": "api_error", "param": None, "code": "host_failed"}}
        events = events_of(fake_admitted([chunk("Hal"), error]))
        assert [e["type"] for e in events][-2:] == ["response.output_text.delta", "response.failed"]
        failed = events[-1]["response"]
        assert failed["status"] == "failed" and failed["error"] == {
            "code": "host_failed",
            "message": "Both hosts failed.",
        }
        assert failed["output"] == []  # a half answer is never presented as one


NOT_OFFERED = [
    ("tools", [{"type": "web_search"}], "tools[0].type"),
    ("tool_choice", {"type": "web_search_preview"}, "tool_choice"),
    ("text", {"verbosity": "low"}, "text.verbosity"),
    ("reasoning", {"effort": "high"}, "reasoning"),
    ("include", ["message.output_text.logprobs"], "include"),
    ("top_logprobs", 3, "top_logprobs"),
    ("truncation", "auto", "truncation"),
    ("background", True, "background"),
    ("prompt", {"id": "pmpt_1"}, "prompt"),
    ("conversation", "conv_1", "conversation"),
    ("max_tool_calls", 2, "max_tool_calls"),
]
BAD = [
    ({**GOOD, "max_output_tokens": 0}, "max_output_tokens"),
    ({**GOOD, "max_output_tokens": 10**9}, "max_output_tokens"),
    ({**GOOD, "temperature": 7}, "temperature"),
    ({**GOOD, "top_p": 2}, "top_p"),
    ({**GOOD, "input": []}, "input"),
    ({**GOOD, "input": 5}, "input"),
    ({**GOOD, "input": ["hi"]}, "input[0]"),
    ({**GOOD, "input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
    ({**GOOD, "input": [{"role": "user", "content": 5}]}, "input[0].content"),
    ({**GOOD, "input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0]"),
    ({**GOOD, "input": [{"role": "system", "content": "only system"}]}, "input"),
    ({**GOOD, "input": "a\x00b"}, "input"),
    ({**GOOD, "stream": "sometimes"}, "stream"),
    ({**GOOD, "metadata": "x"}, "metadata"),
    ({k: v for k, v in GOOD.items() if k != "model"}, "model"),
    ({k: v for k, v in GOOD.items() if k != "input"}, "input"),
]


class RefusalTests:
    @pytest.mark.parametrize(("name", "value", "param"), NOT_OFFERED)
    def test_what_is_not_offered_yet_is_a_400_naming_it(self, customer, name, value, param) -> None:
        error = assert_error(respond(customer.secret, {**GOOD, name: value}), 400, "unsupported_parameter")
        assert error["param"] == param and "not offered" in error["message"]
        assert error["type"] == "invalid_request_error"
        assert not Request.objects.exists()

    @pytest.mark.parametrize(
        ("item", "param"),
        [
            ({"type": "reasoning", "summary": []}, "input[0].type"),
            (
                {"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]},
                "input[0].content[0].type",
            ),
        ],
    )
    def test_input_that_is_not_text_is_refused_by_where_it_is(self, customer, item, param) -> None:
        error = assert_error(respond(customer.secret, {**GOOD, "input": [item]}), 400, "unsupported_parameter")
        assert error["param"] == param

    @pytest.mark.parametrize(("body", "param"), BAD)
    def test_bad_input_names_the_bad_field(self, customer, body, param) -> None:
        error = assert_error(respond(customer.secret, body), 400, "invalid_value")
        assert error["param"] == param
        assert not Hold.objects.exists() and not Job.objects.exists()

    def test_a_prompt_past_the_context_names_the_input(self, customer) -> None:
        error = assert_error(
            respond(customer.secret, {**GOOD, "max_output_tokens": 4000, "input": "elephant " * 400}),
            400,
            "context_length_exceeded",
        )
        assert error["param"] == "input"
        assert not Request.objects.exists()

    def test_an_unknown_model_is_a_404_and_a_stranger_a_401_before_any_check(self, customer) -> None:
        assert_error(respond(customer.secret, {**GOOD, "model": "gpt-9"}), 404, "model_not_found")
        assert_error(respond("el-nope", {**GOOD, "tools": [{"type": "function"}]}), 401, "invalid_api_key")
        assert_error(respond(None, GOOD), 401, "missing_api_key")
        assert_error(post(Client(), None, None, path="/v1/responses", raw=b"{not json"), 401, "missing_api_key")
        assert_error(post(Client(), customer.secret, None, path="/v1/responses", raw=b"{not json"), 400, "invalid_json")

    def test_the_door_error_leaves_other_params_alone(self) -> None:
        from marketplace.openai.responses import door_error

        assert door_error(DomainError("x", param="model")).param == "model"
        assert door_error(DomainError("x", param="messages[2].content")).param == "input"


class ModelRetrieveTests:
    def test_it_answers_the_entry_the_list_gives(self, customer, catalog) -> None:
        serve(catalog)
        entry = listed(customer.secret)["gemma-3-270m"]
        response = Client().get("/v1/models/gemma-3-270m", HTTP_AUTHORIZATION=f"Bearer {customer.secret}")
        assert response.status_code == 200 and response.json() == entry

    def test_an_unknown_or_unserved_model_is_a_404_in_openais_shape(self, customer, catalog) -> None:
        for name in ("gpt-9", "gemma-3-270m", "org/some-model"):  # (nobody serves gemma here)
            error = assert_error(
                Client().get(f"/v1/models/{name}", HTTP_AUTHORIZATION=f"Bearer {customer.secret}"),
                404,
                "model_not_found",
            )
            assert error["type"] == "invalid_request_error" and error["param"] == "model" and name in error["message"]

    def test_a_stranger_is_refused(self, catalog) -> None:
        assert_error(
            Client().get("/v1/models/gemma-3-270m", HTTP_AUTHORIZATION="Bearer el-nope"), 401, "invalid_api_key"
        )


class SchemaTests:
    def test_the_schema_documents_both_answers_and_the_refusals(self) -> None:
        schema = Client().get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
        operation = schema["paths"]["/v1/responses"]["post"]
        assert operation["requestBody"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ResponsesInput"
        }
        content = operation["responses"]["200"]["content"]
        assert content["application/json"]["schema"] == {"$ref": "#/components/schemas/Response"}
        data = content["text/event-stream"]["schema"]["properties"]["data"]
        assert data["contentSchema"] == {
            "anyOf": [{"$ref": "#/components/schemas/ResponseEvent"}]
        }  # no [DONE] after the last
        assert {"400", "401", "402", "404", "502", "504"} <= set(operation["responses"])
        assert schema["paths"]["/v1/models/{model_id}"]["get"]["responses"]["200"]["content"]["application/json"][
            "schema"
        ] == {"$ref": "#/components/schemas/Model"}
