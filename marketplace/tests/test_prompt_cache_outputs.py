"""Issue 53's outputs: the prompt tokens the gateway found cached at admission (`Request.cached_tokens`)
as the Responses API reports them (`usage.input_tokens_details.cached_tokens`: whole, streamed and
stored, read by the `openai` package's types), and in the customer's usage rows and CSV. The web
usage page: web/tests/test_prompt_cache_usage.py."""

from __future__ import annotations

import csv
import io
import json
from typing import TYPE_CHECKING, cast

import pytest
from asgiref.sync import async_to_sync
from django.db import transaction
from django.test import AsyncClient, Client
from openai.types.responses import Response as OpenAIResponse
from openai.types.responses import ResponseCompletedEvent

from billing.services import hold_place
from core.db import db
from marketplace.models import Request
from marketplace.openai.choices import Admitted
from marketplace.openai.responses import echoed, response_from_chat
from marketplace.openai.streaming import Ended, Text
from marketplace.tests.test_apis import post

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from django.http import StreamingHttpResponse

    from catalog.models import CatalogModel
    from testkit.personas import Customer

pytestmark = pytest.mark.django_db(
    transaction=True
)  # the API views are async: their database threads must see the rows

GOOD = {"model": "gemma-3-270m", "input": "Say hi", "max_output_tokens": 8}
PROMPT, CACHED, COMPLETION = 200, 128, 1  # two whole blocks of 64 found cached at admission


class _Listener:
    """A host stood in for: the answer "Hello", then the end of its request."""

    logprobs, sent, model = False, 0, None

    def __init__(self, row: Request) -> None:
        self.row = row

    async def events(self) -> AsyncIterator[Text | Ended]:
        yield Text("Hello")
        yield Ended(self.row)

    async def close(self) -> None:
        return None


def _cached_row(*, customer: Customer, catalog: CatalogModel, public_id: str, stream: bool) -> Request:
    """A request of the customer's, answered, whose prompt admission found partly cached."""
    with transaction.atomic():
        hold = hold_place(user=customer.user, api_key=customer.key, amount_ucents=0)
        return Request.objects.create(
            public_id=public_id,
            user=customer.user,
            api_key=customer.key,
            model=catalog,
            kind="chat",
            params={},
            stream=stream,
            hold=hold,
            status=Request.Status.COMPLETED,
            finish_reason="stop",
            prompt_tokens=PROMPT,
            cached_tokens=CACHED,
            completion_tokens=COMPLETION,
        )


@pytest.fixture
def answered(customer: Customer, catalog: CatalogModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Admission and its host stood in for: a body the door translates is a request row of the
    customer's with `CACHED` of its `PROMPT` tokens cached, that has answered "Hello"."""

    async def admit(
        *, secret: str, body: dict, kind: str, translate: Callable[[dict], dict], new_id: Callable[[str], str]
    ) -> list[Admitted]:
        chat = translate(body)
        row = await db(_cached_row, customer=customer, catalog=catalog, public_id=new_id(kind), stream=chat["stream"])
        return [Admitted(row=row, listener=_Listener(row), include_usage=True)]  # type: ignore[arg-type]

    monkeypatch.setattr("marketplace.openai.apis.admit_choices", admit)


def streamed_events(secret: str, body: dict) -> list[dict]:
    """The Server-Sent Events of a streamed /v1/responses, as JSON objects."""

    async def read() -> bytes:
        response = await AsyncClient().post(
            "/v1/responses",
            data=json.dumps(body),
            content_type="application/json",
            headers={"Authorization": f"Bearer {secret}"},
        )
        assert response.status_code == 200
        return b"".join([piece async for piece in cast("StreamingHttpResponse", response)])

    lines = async_to_sync(read)().decode().splitlines()
    return [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]


EXPECTED_USAGE = {
    "input_tokens": PROMPT,
    "input_tokens_details": {"cached_tokens": CACHED},
    "output_tokens": COMPLETION,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": PROMPT + COMPLETION,
}


class ResponsesUsageTests:
    def test_the_chats_cached_count_is_the_responses_and_none_is_zero(self) -> None:
        def usage_of(chat_usage: dict) -> dict:
            chat = {
                "id": "resp_ab12",
                "created": 1700000000,
                "model": "gemma-3-270m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}],
                "usage": chat_usage,
            }
            return response_from_chat(chat, params={}, echo=echoed(GOOD))["usage"]

        counts = {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}
        usage = usage_of({**counts, "prompt_tokens_details": {"cached_tokens": 8}})
        assert usage["input_tokens"] == 9 and usage["input_tokens_details"] == {"cached_tokens": 8}
        assert usage_of(counts)["input_tokens_details"] == {"cached_tokens": 0}

    def test_a_whole_response_reports_the_count_admission_decided(self, customer, answered) -> None:
        response = post(Client(), customer.secret, GOOD, path="/v1/responses")
        assert response.status_code == 200, response.content
        body = response.json()
        assert body["usage"] == EXPECTED_USAGE
        parsed = OpenAIResponse.construct(**body)  # as the `openai` package's client reads a body (unvalidated)
        assert parsed.usage is not None and parsed.usage.input_tokens_details.cached_tokens == CACHED

    def test_a_streamed_response_reports_it_on_its_last_event(self, customer, answered) -> None:
        events = streamed_events(customer.secret, {**GOOD, "stream": True})
        assert [e["type"] for e in events][-1] == "response.completed"
        assert all(e["response"]["usage"] is None for e in events[:2])  # created, in_progress: none yet
        assert events[-1]["response"]["usage"] == EXPECTED_USAGE
        completed = ResponseCompletedEvent.construct(**events[-1])
        assert completed.response.usage is not None
        assert completed.response.usage.input_tokens_details.cached_tokens == CACHED

    @pytest.mark.parametrize("stream", [False, True])
    def test_a_stored_response_reads_back_with_the_same_count(self, customer, answered, stream: bool) -> None:
        body = {**GOOD, "store": True, "stream": stream}
        if stream:
            response_id = streamed_events(customer.secret, body)[-1]["response"]["id"]
        else:
            response_id = post(Client(), customer.secret, body, path="/v1/responses").json()["id"]
        again = Client().get(f"/v1/responses/{response_id}", HTTP_AUTHORIZATION=f"Bearer {customer.secret}")
        assert again.status_code == 200 and again.json()["usage"] == EXPECTED_USAGE


class UsageExportTests:
    def _requests(self, customer: Customer, catalog: CatalogModel) -> list[Request]:
        made = [
            _cached_row(customer=customer, catalog=catalog, public_id=f"chatcmpl-cache{n}", stream=False)
            for n in range(2)
        ]
        Request.objects.filter(pk=made[1].pk).update(cached_tokens=0)
        return made

    def test_the_usage_api_rows_carry_the_cached_count(self, customer, catalog) -> None:
        cached, uncached = self._requests(customer, catalog)
        body = Client().get("/v1/usage", HTTP_AUTHORIZATION=f"Bearer {customer.secret}").json()
        assert [(row["id"], row["prompt_tokens"], row["cached_tokens"]) for row in body["data"]] == [
            (cached.public_id, PROMPT, CACHED),
            (uncached.public_id, PROMPT, 0),
        ]

    def test_the_csv_appends_a_cached_tokens_column_after_the_ones_it_had(self, customer, catalog) -> None:
        cached, uncached = self._requests(customer, catalog)
        response = Client().get("/v1/usage.csv", HTTP_AUTHORIZATION=f"Bearer {customer.secret}")
        text = b"".join(response).decode()
        assert text.splitlines()[0] == (
            "id,created,model,key_prefix,status,prompt_tokens,completion_tokens,cost_ucents,cached_tokens"
        )
        rows = list(csv.DictReader(io.StringIO(text)))
        assert [(r["id"], r["prompt_tokens"], r["cached_tokens"]) for r in rows] == [
            (cached.public_id, str(PROMPT), str(CACHED)),
            (uncached.public_id, str(PROMPT), "0"),
        ]
