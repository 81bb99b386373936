"""End to end (issue 34): function tools, `text.format` and streamed call arguments through the
`openai` package against a real daphne gateway and real mahout hosts running the shipped model.
A function tool's round trip (the call made under the call's grammar, its output sent back, an
answer), whole and streamed; the openai package's own typed events and its stream helper, which
rebuilds the response from them; a JSON-schema format through `responses.parse`; tool-call
arguments delta by delta on the chat stream too; a host killed in the middle of a call's
arguments, the call finishing on another host with each character once; bad input, 400s in
OpenAI's shape. The shipped model is a small base model: these check the protocol, not the
answers' sense."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import httpx
import jsonschema
import openai
import pydantic
import pytest
from openai.types.responses import (
    ResponseCompletedEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseFunctionToolCall,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
)

from billing import selectors as ledger
from billing.models import Hold
from catalog.pricing import price
from conftest import make_customer, make_host
from marketplace.models import Request
from marketplace.tests.test_e2e import client
from marketplace.tests.test_failover_e2e import Farm, serving_host
from marketplace.tests.test_responses_e2e import customer_served, generation  # noqa: F401 (a fixture)
from marketplace.tests.test_resume import events
from testkit.evidence import drawn
from testkit.personas import present

if TYPE_CHECKING:
    from collections.abc import Callable

    from catalog.models import CatalogModel
    from testkit.personas import Customer
    from testkit.stack import Gateway, Mahout

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e]

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
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
ASK = "What is the weather in Paris?"
STORY = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 160, "maxLength": 200}},
    "required": ["story"],
    "additionalProperties": False,
}  # arguments long enough to kill a host in the middle
TELL = {"type": "function", "name": "tell", "description": "Tell a story.", "parameters": STORY, "strict": True}


def assert_billed_as_reported(gateway: Gateway, customer: Customer, response_id: str, usage: object) -> None:
    """The usage a response reported is its row's, as billed; every request of the customer
    settled, and the ledger balances."""
    record = generation(gateway, customer, response_id)
    assert record["status"] == "completed" and record["kind"] == "chat"
    assert (record["prompt_tokens"], record["completion_tokens"]) == (usage.input_tokens, usage.output_tokens)  # type: ignore[attr-defined]
    rows = Request.objects.filter(api_key=customer.key)
    assert all(
        row.messages is None
        and row.cost_ucents
        == price(
            row.model,
            prompt_tokens=row.prompt_tokens,
            completion_tokens=row.completion_tokens,
            cached_tokens=row.cached_tokens,  # (a later turn's prefix the host holds)
        )
        for row in rows
    )
    spent = sum(row.cost_ucents for row in rows)
    assert ledger.customer_account(user=customer.user).balance_ucents == 500_000_000 - spent
    assert not Hold.objects.filter(status="active").exists() and ledger.ledger_total() == 0


class ToolRoundTripTests:
    def test_a_required_call_its_output_sent_back_and_an_answer_whole(self, gateway, customer_served) -> None:  # noqa: F811
        api = client(gateway, customer_served)
        first = api.responses.create(
            model="gemma-3-270m",
            input=ASK,
            tools=[TOOL],
            tool_choice="required",
            max_output_tokens=60,
            temperature=0,
            parallel_tool_calls=False,
        )
        assert first.status == "completed" and [item.type for item in first.output] == ["function_call"], first.output
        call = first.output[0]
        assert isinstance(call, ResponseFunctionToolCall) and call.name == "get_weather" and call.status == "completed"
        assert call.call_id.startswith("call_") and call.id.startswith("fc_")
        jsonschema.validate(json.loads(call.arguments), WEATHER)  # made under the call's grammar
        assert first.tools[0].name == "get_weather" and first.tool_choice == "required" and first.output_text == ""
        assert first.parallel_tool_calls is False
        assert_billed_as_reported(gateway, customer_served, first.id, first.usage)

        then = api.responses.create(
            model="gemma-3-270m",
            tools=[TOOL],
            max_output_tokens=12,
            temperature=0,
            input=[
                {"role": "user", "content": ASK},
                *(item.model_dump(exclude_none=True) for item in first.output),
                {"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"},
            ],
        )
        assert then.status in ("completed", "incomplete") and then.output and then.usage.output_tokens > 0
        assert then.usage.input_tokens > first.usage.input_tokens, "the call and its output were in the prompt"
        row = Request.objects.get(public_id=then.id)
        assert row.status == "completed" and row.messages is None  # settled, and the conversation deleted

    def test_a_streamed_call_sends_its_arguments_delta_by_delta_as_the_openai_stream_helper_reads_them(
        self,
        gateway,
        customer_served,  # noqa: F811
    ) -> None:
        api = client(gateway, customer_served)
        whole = api.responses.create(
            model="gemma-3-270m",
            input=ASK,
            tools=[TOOL],
            tool_choice="required",
            max_output_tokens=60,
            temperature=0,
            parallel_tool_calls=False,
        )
        with api.responses.stream(
            model="gemma-3-270m",
            input=ASK,
            tools=[TOOL],
            tool_choice="required",
            max_output_tokens=60,
            temperature=0,
            parallel_tool_calls=False,
        ) as stream:
            events = list(stream)
            final = stream.get_final_response()  # the package's own accumulation of the events

        def first(kind: type) -> int:
            return next(at for at, event in enumerate(events) if isinstance(event, kind))

        deltas = [event for event in events if isinstance(event, ResponseFunctionCallArgumentsDeltaEvent)]
        assert len(deltas) >= 2, "the arguments arrive in several events, as they are generated"
        added = next(event for event in events if isinstance(event, ResponseOutputItemAddedEvent))
        assert added.item.type == "function_call" and added.item.name == "get_weather" and added.item.arguments == ""
        assert (
            first(ResponseOutputItemAddedEvent)
            < first(ResponseFunctionCallArgumentsDeltaEvent)
            < first(ResponseFunctionCallArgumentsDoneEvent)
            < first(ResponseOutputItemDoneEvent)
        )
        assert deltas[-1].snapshot == final.output[0].arguments  # type: ignore[attr-defined,union-attr]  # the helper's own join
        done = next(event for event in events if isinstance(event, ResponseFunctionCallArgumentsDoneEvent))
        item_done = next(event for event in events if isinstance(event, ResponseOutputItemDoneEvent))
        arguments = "".join(delta.delta for delta in deltas)
        assert done.arguments == arguments == item_done.item.arguments == final.output[0].arguments  # type: ignore[union-attr]
        assert isinstance(events[-1], ResponseCompletedEvent) and final.status == "completed"
        assert [event.sequence_number for event in events] == list(range(len(events)))
        assert arguments == whole.output[0].arguments, "greedy decoding on one host: the same call, whole or streamed"  # type: ignore[union-attr]
        jsonschema.validate(json.loads(arguments), WEATHER)
        assert_billed_as_reported(gateway, customer_served, final.id, final.usage)

        call = final.output[0]
        answered = list(
            api.responses.create(
                model="gemma-3-270m",
                tools=[TOOL],
                max_output_tokens=12,
                temperature=0,
                stream=True,
                input=[
                    {"role": "user", "content": ASK},
                    call.model_dump(exclude_none=True),
                    {"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"},
                ],
            )
        )  # type: ignore[union-attr]
        then = answered[-1].response  # type: ignore[union-attr]  # (incomplete when cut by max_output_tokens)
        assert answered[-1].type in ("response.completed", "response.incomplete") and then.output
        assert then.usage.input_tokens > final.usage.input_tokens, "the call and its output were in the prompt"
        assert_billed_as_reported(gateway, customer_served, then.id, then.usage)

    def test_chat_streams_a_calls_arguments_delta_by_delta_too(self, gateway, customer_served) -> None:  # noqa: F811
        api = client(gateway, customer_served)
        chat_tool = [{"type": "function", "function": {k: TOOL[k] for k in ("name", "description", "parameters")}}]
        pieces, named = [], []
        for chunk in api.chat.completions.create(
            model="gemma-3-270m",
            messages=[{"role": "user", "content": ASK}],
            tools=chat_tool,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=60,
            temperature=0,
            stream=True,
        ):
            for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                if delta.id:
                    named.append((delta.id, delta.type, delta.function.name, delta.function.arguments))
                else:
                    assert delta.function.name is None and delta.index == 0
                    pieces.append(delta.function.arguments)
        assert len(named) == 1 and named[0][1:] == ("function", "get_weather", ""), "the first delta names the call"
        assert len(pieces) >= 2, "the arguments arrive in several chunks, as they are generated"
        jsonschema.validate(json.loads("".join(pieces)), WEATHER)


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    population: int


class FormatTests:
    def test_a_json_schema_format_through_the_openai_packages_parse(self, gateway, customer_served) -> None:  # noqa: F811
        api = client(gateway, customer_served)
        parsed = api.responses.parse(
            model="gemma-3-270m",
            input="Name a city and its population.",
            text_format=City,
            max_output_tokens=60,
            temperature=0,
        )
        assert parsed.status == "completed" and isinstance(parsed.output_parsed, City)
        assert parsed.text.format.type == "json_schema" and parsed.text.format.name == "City"  # type: ignore[union-attr]
        loose = api.responses.create(
            model="gemma-3-270m",
            input="Describe Paris as JSON.",
            max_output_tokens=40,
            temperature=0,
            text={"format": {"type": "json_object"}},
        )
        if loose.status == "completed":  # (cut by max_output_tokens, the JSON may be unfinished, as OpenAI leaves it)
            assert isinstance(json.loads(loose.output_text), dict)


BAD = [
    ({"tools": [{"type": "banana", "name": "f"}]}, "tools[0].type", "invalid_value"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "get_time"}}, "tool_choice", "invalid_value"),
    (
        {
            "input": [
                {"role": "user", "content": ASK},
                {"type": "function_call_output", "call_id": "call_x", "output": "1"},
            ]
        },
        "input[1].call_id",
        "invalid_value",
    ),
    (
        {
            "text": {
                "format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "minProperties": "one"}}
            }
        },
        "text.format",
        "invalid_value",
    ),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "unsupported_parameter"),
]


class RefusalTests:
    @pytest.mark.parametrize(("extra", "param", "code"), BAD)
    def test_bad_input_is_a_400_in_openais_shape(self, gateway, catalog, extra, param, code) -> None:  # noqa: ANN001
        api = client(gateway, make_customer())
        with pytest.raises(openai.BadRequestError) as refused:
            api.responses.create(**{"model": "gemma-3-270m", "input": ASK, "max_output_tokens": 8, **extra})
        error = refused.value
        assert error.status_code == 400 and error.code == code and error.param == param, error.body
        assert error.type == "invalid_request_error" and not Request.objects.exists()


@pytest.fixture
def farm(gateway: Gateway, catalog: CatalogModel, start_mahout: Callable[..., Mahout]) -> Farm:
    return Farm(start_mahout)


def kill_after_arguments_begin(farm: Farm, public_id: str, victim: list[int]) -> None:
    victim.append(serving_host(public_id))
    farm.process(victim[0]).kill()


WRAPPER = len('{"tool_calls":[{"name":"tell","arguments":}]}')  # the answer around the arguments, less any whitespace


def assert_each_character_once(public_id: str, arguments: str, dead_host: int) -> None:
    """The call finished on a second host; the characters both hosts generated are the answer's,
    once each: the arguments the customer got and the call around them (whitespace aside)."""
    row = Request.objects.get(public_id=public_id)
    jobs = list(row.jobs.order_by("attempt"))
    assert row.status == "completed" and row.resumed and [job.attempt for job in jobs] == [1, 2]
    assert jobs[0].host_id == dead_host and jobs[0].status == "failed" and jobs[0].generated_chars > 0
    assert sum(job.generated_chars for job in jobs) == row.delivered_chars
    assert 0 <= row.delivered_chars - len(arguments) - WRAPPER <= 12, (row.delivered_chars, len(arguments))
    jsonschema.validate(json.loads(arguments), STORY)


class FailoverTests:
    def test_a_host_killed_in_the_middle_of_a_calls_arguments_the_call_finishes_on_another(self, gateway, farm) -> None:
        farm.add("left")
        farm.add("right")
        customer = make_customer()
        api = client(gateway, customer)
        # The chat stream: arguments delta by delta, a kill after the first piece, the rest from the other host.
        victim: list[int] = []
        pieces, last = [], None
        chat_tool = [{"type": "function", "function": {k: TELL[k] for k in ("name", "description", "parameters")}}]
        for chunk in api.chat.completions.create(
            model="gemma-3-270m",
            messages=[{"role": "user", "content": "A story."}],
            tools=chat_tool,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=160,
            temperature=0,
            stream=True,
        ):
            last = chunk
            for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                if delta.function.arguments:
                    pieces.append(delta.function.arguments)
                    if not victim:
                        kill_after_arguments_begin(farm, chunk.id, victim)
        assert last is not None and last.choices[0].finish_reason == "tool_calls"
        assert last.model_extra.get("x_elephant") == {"resumed": True}
        arguments = "".join(pieces)
        assert_each_character_once(last.id, arguments, victim[0])
        farm.process(victim[0]).wait(timeout=10)
        farm.restart(victim[0])

        # The Responses stream: the same, its last event saying it was resumed.
        victim.clear()
        deltas: list[str] = []
        events = []
        for event in api.responses.create(
            model="gemma-3-270m",
            input="A story.",
            tools=[TELL],
            tool_choice="required",
            max_output_tokens=160,
            temperature=0,
            stream=True,
            parallel_tool_calls=False,
        ):
            events.append(event)
            if isinstance(event, ResponseFunctionCallArgumentsDeltaEvent):
                deltas.append(event.delta)
                if not victim:
                    kill_after_arguments_begin(farm, events[0].response.id, victim)
        final = events[-1]
        assert isinstance(final, ResponseCompletedEvent) and final.model_extra.get("x_elephant") == {"resumed": True}
        done = next(event for event in events if isinstance(event, ResponseFunctionCallArgumentsDoneEvent))
        assert done.arguments == "".join(deltas) == final.response.output[0].arguments  # type: ignore[union-attr]
        assert_each_character_once(final.response.id, done.arguments, victim[0])


CALL_BATCHES = ['{"tool_calls": [{"name": "get_weather", "arguments": {"ci', 'ty": "Par', 'is"}}]}']


class ResumeTests:
    def test_a_dropped_chat_stream_resumes_a_calls_arguments_where_its_customer_left_them(
        self, gateway, catalog
    ) -> None:
        customer, serving = make_customer(), present(make_host(name="resumer"))
        key, host = {"Authorization": f"Bearer {customer.secret}"}, {"Authorization": f"Bearer {serving.token}"}
        chat_tool = [{"type": "function", "function": {k: TOOL[k] for k in ("name", "description", "parameters")}}]
        body = {
            "model": "gemma-3-270m",
            "messages": [{"role": "user", "content": ASK}],
            "max_tokens": 50,
            "stream": True,
            "tools": chat_tool,
            "tool_choice": "required",
            "parallel_tool_calls": False,
        }
        with httpx.Client(base_url=gateway.url, timeout=30) as http:
            before: list[dict] = []
            with http.stream("POST", "/v1/chat/completions", json=body, headers=key) as stream:
                lines = events(stream)
                public_id = json.loads(next(lines))["id"]
                job = http.post(
                    "/hosts/api/claim", json={"fingerprint": serving.fingerprint, "wait": 10}, headers=host
                ).json()["job"]["id"]
                http.post(
                    f"/hosts/api/jobs/{job}/tokens", json={"seq": 0, "text": CALL_BATCHES[0]}, headers=host
                ).raise_for_status()
                while len(before) < 2:  # the call named, then the first piece of its arguments
                    chunk = json.loads(next(lines))
                    before += chunk["choices"][0]["delta"].get("tool_calls") or []
                    offset = chunk["x_elephant"]["offset"]
            for seq, text in enumerate(CALL_BATCHES[1:], start=1):  # the connection dropped; the host goes on
                http.post(
                    f"/hosts/api/jobs/{job}/tokens", json={"seq": seq, "text": text}, headers=host
                ).raise_for_status()
            http.post(
                f"/hosts/api/jobs/{job}/complete", json={"finish_reason": "stop", "tokens": drawn(job)}, headers=host
            ).raise_for_status()
            after, finish = [], None
            with http.stream(
                "GET", f"/v1/chat/completions/{public_id}?stream=true&starting_after={offset}", headers=key
            ) as resumed:
                for data in events(resumed):
                    if data == "[DONE]":
                        break
                    choice = json.loads(data)["choices"][0]
                    after += choice["delta"].get("tool_calls") or []
                    finish = choice["finish_reason"] or finish
        assert before[0]["function"] == {"name": "get_weather", "arguments": ""} and before[0]["id"].startswith("call_")
        assert before[1]["function"]["arguments"] == '{"ci' and offset == len(CALL_BATCHES[0])
        assert all("id" not in delta for delta in after), "the call was named before the drop: not again"
        assert (
            "".join(d["function"]["arguments"] for d in before + after) == '{"city": "Paris"}'
            and finish == "tool_calls"
        )
