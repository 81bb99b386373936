"""End to end (issue 34): the `openai` package's `client.responses.create`, whole and streamed,
and `client.models.retrieve`, against a real daphne gateway and a real mahout host running the
shipped model. A response is admitted, run and settled as a chat: the usage it reports is the
request's row, read back through GET /v1/generation with its resp_ id."""

from __future__ import annotations

from typing import TYPE_CHECKING

import httpx
import pytest

from billing import selectors as ledger
from billing.models import Hold
from catalog.pricing import price
from conftest import make_customer, make_host
from marketplace.models import Request
from marketplace.tests.test_e2e import client

if TYPE_CHECKING:
    from collections.abc import Callable

    from catalog.models import CatalogModel
    from testkit.personas import Customer
    from testkit.stack import Gateway, Mahout

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e]

ORDER = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


@pytest.fixture
def customer_served(gateway: Gateway, catalog: CatalogModel, start_mahout: Callable[..., Mahout]) -> Customer:
    """A customer with credit, and one real host serving the shipped model."""
    start_mahout(make_host(qualified=False, name="responses-rig").token)
    return make_customer()


def generation(gateway: Gateway, customer: Customer, public_id: str) -> dict:
    return httpx.get(
        f"{gateway.url}/v1/generation",
        params={"id": public_id},
        timeout=10,
        headers={"Authorization": f"Bearer {customer.secret}"},
    ).json()


def assert_settled_as_reported(gateway: Gateway, customer: Customer, response_id: str, usage: object) -> None:
    """The usage the response reported is what the request's row holds and what was billed."""
    record = generation(gateway, customer, response_id)
    assert record["id"] == response_id and record["status"] == "completed" and record["kind"] == "chat"
    assert (record["prompt_tokens"], record["completion_tokens"]) == (usage.input_tokens, usage.output_tokens)  # type: ignore[attr-defined]
    row = Request.objects.get(public_id=response_id)
    assert (
        row.cost_ucents
        == record["cost_ucents"]
        == price(
            row.model,
            prompt_tokens=row.prompt_tokens,
            completion_tokens=row.completion_tokens,
            cached_tokens=row.cached_tokens,
        )
    )  # (a later turn's prefix the host holds: at the cached price)
    assert row.messages is None and Hold.objects.filter(status="active").count() == 0
    assert ledger.customer_account(user=customer.user).balance_ucents == 500_000_000 - row.cost_ucents
    assert ledger.ledger_total() == 0


class ResponsesTests:
    def test_a_whole_response_has_the_text_and_usage_billed_on_its_row(self, gateway, customer_served) -> None:
        customer = customer_served
        answer = client(gateway, customer).responses.create(
            model="gemma-3-270m",
            instructions="You are a poet.",
            input="Write a haiku about elephants.",
            max_output_tokens=12,
            temperature=0,
        )
        assert answer.id.startswith("resp_") and answer.object == "response" and answer.model == "gemma-3-270m"
        assert answer.status in ("completed", "incomplete") and answer.output_text.strip()
        assert answer.output[0].type == "message" and answer.output[0].content[0].type == "output_text"
        assert answer.instructions == "You are a poet." and answer.max_output_tokens == 12
        assert 1 <= answer.usage.output_tokens <= 12
        assert answer.usage.total_tokens == answer.usage.input_tokens + answer.usage.output_tokens
        assert_settled_as_reported(gateway, customer, answer.id, answer.usage)

    def test_a_streamed_response_sends_the_events_in_order_and_its_deltas_join_to_the_text(
        self, gateway, customer_served
    ) -> None:
        customer = customer_served
        api = client(gateway, customer)
        conversation = [{"role": "user", "content": [{"type": "input_text", "text": "Write a haiku about elephants."}]}]
        events = list(
            api.responses.create(
                model="gemma-3-270m", input=conversation, max_output_tokens=16, temperature=0, stream=True
            )
        )
        kinds = [event.type for event in events]
        deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
        assert len(deltas) >= 2, "text must arrive in several events, not one buffered body"
        assert [kind for index, kind in enumerate(kinds) if index == 0 or kind != kinds[index - 1]][:-1] == ORDER
        assert kinds[-1] in ("response.completed", "response.incomplete")
        assert [event.sequence_number for event in events] == list(range(len(events)))
        final = events[-1].response
        text = "".join(deltas)
        assert text.strip() and final.output_text == text
        assert next(e for e in events if e.type == "response.output_text.done").text == text
        assert final.id == events[0].response.id and final.id.startswith("resp_")
        assert_settled_as_reported(gateway, customer, final.id, final.usage)

        whole = api.responses.create(model="gemma-3-270m", input=conversation, max_output_tokens=16, temperature=0)
        # Not compared with the streamed text: the host reuses its cached prompt, whose logits drift at a near tie.
        assert whole.output_text.strip() and whole.usage.input_tokens == final.usage.input_tokens

    def test_models_retrieve_gives_the_listed_entry_and_a_404_for_an_unknown_id(self, gateway, customer_served) -> None:
        import openai

        api = client(gateway, customer_served)
        model = api.models.retrieve("gemma-3-270m")
        listed = next(entry for entry in api.models.list().data if entry.id == "gemma-3-270m")
        assert model.id == "gemma-3-270m" and model.object == "model" and model.owned_by == "elephant"
        assert model.model_dump() == listed.model_dump()
        with pytest.raises(openai.NotFoundError) as refused:
            api.models.retrieve("gpt-9")
        assert refused.value.code == "model_not_found"


class UnservedTests:
    def test_nobody_claims_so_a_whole_response_is_a_504_and_a_stream_ends_with_response_failed(
        self, gateway, catalog
    ) -> None:
        import openai

        customer = make_customer()
        api = client(gateway, customer)
        with pytest.raises(openai.APIStatusError) as refused:
            api.responses.create(model="gemma-3-270m", input="Say hi", max_output_tokens=8)
        assert refused.value.status_code == 504 and refused.value.body["code"] == "queue_timeout"  # type: ignore[index]
        events = list(api.responses.create(model="gemma-3-270m", input="Say hi", max_output_tokens=8, stream=True))
        assert [event.type for event in events][:2] == ["response.created", "response.in_progress"]
        assert events[-1].type == "response.failed" and "response.completed" not in [event.type for event in events]
        failed = events[-1].response
        assert failed.status == "failed" and failed.error.code == "queue_timeout" and failed.output == []
        assert set(Request.objects.values_list("status", "cost_ucents")) == {("failed", 0)}
        assert ledger.customer_account(user=customer.user).held_ucents == 0
