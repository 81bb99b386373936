"""End to end (issue 34): stored responses through the `openai` package against a real daphne
gateway and a real mahout host running the shipped model. A conversation stored with
`store=True` is continued with `previous_response_id`: the second turn's prompt is the first
turn's input and answer and then its own (the same tokens, billed, as the whole conversation
sent by hand); retrieved and deleted by its account, a 404 for another's and once deleted;
nothing is stored without `store`.

Greedy answers are not compared across requests: a host that reuses its KV cache for a prompt's
prefix evaluates the rest in a different batch, and a near tie in the base model's logits can
then flip the first token. What must match is the prompt the host is fed (`host_prompt`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from catalog.rendering import prompt_fragments
from catalog.selectors import catalog_model_by_name
from conftest import make_customer
from marketplace.models import Request, StoredResponse
from marketplace.openai.responses import chat_body, continued
from marketplace.openai.serializers import ChatInputSerializer
from marketplace.tests.test_e2e import client
from marketplace.tests.test_responses_e2e import customer_served  # noqa: F401  (the fixture)
from protocol.rendering import fragments_text

if TYPE_CHECKING:
    from testkit.personas import Customer
    from testkit.stack import Gateway

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e]

ASK = dict(model="gemma-3-270m", max_output_tokens=8, temperature=0)
FIRST = "My name is Ada. Say hello."
SECOND = "What is my name?"


def host_prompt(body: dict, *, previous_id: str | None = None) -> str:
    """The prompt a host is fed for a Responses body (continuing the stored `previous_id`), by
    the gateway's own translation, validation and rendering."""
    if previous_id is not None:
        body = continued(body, StoredResponse.objects.get(request__public_id=previous_id).conversation)
    serializer = ChatInputSerializer(data=chat_body(body))
    assert serializer.is_valid(), serializer.errors
    data = serializer.validated_data
    model = catalog_model_by_name(name=data["model"])
    return fragments_text(prompt_fragments(model, kind=Request.Kind.CHAT, messages=data["messages"], prompt=None))


class StoredConversationTests:
    def test_a_stored_turn_is_continued_read_back_and_deleted(
        self, gateway: Gateway, customer_served: Customer  # noqa: F811
    ) -> None:  # noqa: F811
        import openai

        api = client(gateway, customer_served)
        first = api.responses.create(input=FIRST, store=True, instructions="Be brief.", **ASK)  # type: ignore[arg-type]
        assert first.store is True and first.output_text
        second = api.responses.create(input=SECOND, previous_response_id=first.id, store=True, **ASK)  # type: ignore[arg-type]
        assert second.previous_response_id == first.id and second.instructions is None

        whole = [
            {"role": "user", "content": FIRST},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": SECOND},
        ]
        by_hand = api.responses.create(input=whole, **ASK)  # type: ignore[arg-type]  # the same conversation, stateless
        assert (
            second.usage.input_tokens
            == by_hand.usage.input_tokens
            > first.usage.input_tokens + first.usage.output_tokens
        )
        assert host_prompt({"input": SECOND, **ASK}, previous_id=first.id) == host_prompt({"input": whole, **ASK})
        billed = Request.objects.get(public_id=second.id)
        assert billed.prompt_tokens == second.usage.input_tokens and billed.messages is None  # the row forgets as any

        assert api.responses.retrieve(second.id).model_dump() == second.model_dump()
        third = api.responses.create(input="And again?", previous_response_id=second.id, **ASK)  # type: ignore[arg-type]
        assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens  # the chain holds

        api.responses.delete(second.id)
        for attempt in (lambda: api.responses.retrieve(second.id), lambda: api.responses.delete(second.id)):
            with pytest.raises(openai.NotFoundError):
                attempt()
        with pytest.raises(openai.NotFoundError) as refused:
            api.responses.create(input=SECOND, previous_response_id=second.id, **ASK)  # type: ignore[arg-type]
        assert refused.value.code == "previous_response_not_found"
        assert list(StoredResponse.objects.values_list("request__public_id", flat=True)) == [first.id]

    def test_another_account_can_neither_read_continue_nor_delete_it(
        self, gateway: Gateway, customer_served: Customer  # noqa: F811
    ) -> None:  # noqa: F811
        import openai

        first = client(gateway, customer_served).responses.create(input=FIRST, store=True, **ASK)  # type: ignore[arg-type]
        outsider = client(gateway, make_customer())
        for attempt in (
            lambda: outsider.responses.retrieve(first.id),
            lambda: outsider.responses.delete(first.id),
            lambda: outsider.responses.create(input=SECOND, previous_response_id=first.id, **ASK),
        ):  # type: ignore[arg-type]
            with pytest.raises(openai.NotFoundError):
                attempt()
        assert StoredResponse.objects.count() == 1 and Request.objects.count() == 1

    def test_a_streamed_stored_response_is_kept_before_its_last_event(
        self, gateway: Gateway, customer_served: Customer  # noqa: F811
    ) -> None:  # noqa: F811
        api = client(gateway, customer_served)
        events = list(api.responses.create(input=FIRST, store=True, stream=True, **ASK))  # type: ignore[arg-type]
        final = events[-1].response
        assert final.store is True and api.responses.retrieve(final.id).model_dump() == final.model_dump()

    def test_without_store_nothing_is_kept(self, gateway: Gateway, customer_served: Customer) -> None:  # noqa: F811
        import openai

        api = client(gateway, customer_served)
        answer = api.responses.create(input=FIRST, **ASK)  # type: ignore[arg-type]
        streamed = list(api.responses.create(input=FIRST, stream=True, **ASK))[-1].response  # type: ignore[arg-type]
        assert answer.store is False and streamed.store is False and not StoredResponse.objects.exists()
        with pytest.raises(openai.NotFoundError):
            api.responses.retrieve(answer.id)

    def test_a_function_calls_output_continues_the_stored_response_that_made_the_call(
        self, gateway: Gateway, customer_served: Customer  # noqa: F811
    ) -> None:  # noqa: F811
        from marketplace.tests.test_responses_tools_e2e import ASK as WEATHER_ASK
        from marketplace.tests.test_responses_tools_e2e import TOOL

        api = client(gateway, customer_served)
        first = api.responses.create(
            model="gemma-3-270m",
            input=WEATHER_ASK,
            tools=[TOOL],
            tool_choice="required",  # type: ignore[list-item]
            max_output_tokens=60,
            temperature=0,
            parallel_tool_calls=False,
            store=True,
        )
        call = first.output[0]
        assert call.type == "function_call"
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"}
        ask = dict(model="gemma-3-270m", tools=[TOOL], max_output_tokens=12, temperature=0)
        then = api.responses.create(previous_response_id=first.id, input=[result], **ask)  # type: ignore[arg-type]
        whole = [{"role": "user", "content": WEATHER_ASK}, call.model_dump(exclude_none=True), result]
        by_hand = api.responses.create(input=whole, **ask)  # type: ignore[arg-type]
        assert then.usage.input_tokens == by_hand.usage.input_tokens and then.output
        assert host_prompt({"input": [result], **ask}, previous_id=first.id) == host_prompt({"input": whole, **ask})
