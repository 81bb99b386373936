"""Stored responses (issue 34): `store: true` keeps a Response and its conversation for
RESPONSE_STORE_SECONDS, read, continued and deleted only by its account, then deleted by the
watchdog's sweep; what it keeps is normalised and bounded (issue 50). The same through the
`openai` package against a real gateway and host: test_responses_store_e2e.py."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from typing import TYPE_CHECKING

import pytest
from django.db import transaction
from django.test import Client
from django.utils import timezone

from accounts.services import api_key_create
from billing.models import Hold
from billing.services import hold_place
from conftest import make_customer
from core.db import db
from core.http import holds_nul
from marketplace import tasks
from marketplace.models import Request, StoredResponse
from marketplace.openai.choices import Admitted
from marketplace.openai.responses import chat_body, continued, conversation_after, stored_items, validated
from marketplace.openai.stored_responses import stored_response_save, stored_responses_expire, stored_turn_admit
from marketplace.openai.streaming import Ended, Text
from marketplace.tests.test_apis import assert_error, post

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from catalog.models import CatalogModel
    from testkit.personas import Customer

pytestmark = pytest.mark.django_db(
    transaction=True
)  # the API views are async: their database threads must see the rows

GOOD = {"model": "gemma-3-270m", "input": "Say hi", "max_output_tokens": 8}
CALL = {
    "id": "fc_1",
    "type": "function_call",
    "status": "completed",
    "call_id": "call_1",
    "name": "weather",
    "arguments": '{"city":"Oslo"}',
}
EARLIER = [{"type": "message", "role": "user", "content": "Weather in Oslo?"}, CALL]


def stored(customer: Customer, catalog: CatalogModel, public_id: str, *, key: object = None) -> StoredResponse:
    """A request of `customer`'s (made with `key`, its first key unless told) whose response is stored."""
    key = key or customer.key
    with transaction.atomic():
        hold = hold_place(user=customer.user, api_key=key, amount_ucents=0)
        row = Request.objects.create(
            public_id=public_id, user=customer.user, api_key=key, model=catalog, kind="chat", params={}, hold=hold
        )
    body = {"id": public_id, "object": "response", "output": [CALL], "store": True}
    return stored_response_save(
        request_id=row.pk, kept=stored_items(validated({**GOOD, "input": EARLIER[:1]})["input"]), response=body
    )


def call(method: str, secret: str, response_id: str) -> object:
    return getattr(Client(), method)(f"/v1/responses/{response_id}", HTTP_AUTHORIZATION=f"Bearer {secret}")


class ConversationTests:
    def test_the_stored_items_come_before_this_turns_input_and_only_its_instructions_count(self) -> None:
        body = continued(
            {
                **GOOD,
                "instructions": "Be brief.",
                "input": [{"type": "function_call_output", "call_id": "call_1", "output": "sunny"}],
            },
            EARLIER,
        )
        assert chat_body(body)["messages"] == [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city":"Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]

    def test_a_string_input_is_one_more_user_message_and_a_bad_input_is_left_to_validation(self) -> None:
        assert continued(GOOD, EARLIER)["input"] == [*EARLIER, {"type": "message", "role": "user", "content": "Say hi"}]
        assert continued({**GOOD, "input": 5}, EARLIER)["input"] == 5

    def test_what_is_kept_is_the_input_then_the_output_each_item_with_only_what_a_turn_needs(self) -> None:
        kept = stored_items(validated({**GOOD, "input": "Hi"})["input"])
        message = {
            "id": "msg_1",
            "type": "message",
            "status": "completed",
            "role": "assistant",
            "content": [
                {"type": "output_text", "text": "Hel", "annotations": [], "logprobs": []},
                {"type": "output_text", "text": "lo", "annotations": [], "logprobs": []},
            ],
        }
        assert conversation_after(kept, {"output": [message, CALL]}) == [
            {"type": "message", "role": "user", "content": "Hi"},
            {"type": "message", "role": "assistant", "content": "Hello"},
            {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city":"Oslo"}'},
        ]

    def test_unknown_keys_ids_and_parts_are_not_kept_and_the_kept_items_validate_to_the_same_turns(self) -> None:
        junk = {"junk": "j" * 1000, "id": "msg_9", "status": "completed"}
        given = [
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "Be brief.", **junk}],
                **junk,
            },
            {"role": "user", "content": "Weather in Oslo?", **junk},
            {**CALL, **junk},
            {
                "type": "function_call_output",
                "call_id": "call_1",
                "output": [{"type": "input_text", "text": "sunny"}],
                **junk,
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Sunny.", "annotations": []}],
            },
        ]
        turns = validated({**GOOD, "input": given})["input"]
        kept = stored_items(turns)
        assert kept == [
            {"type": "message", "role": "system", "content": "Be brief."},
            {"type": "message", "role": "user", "content": "Weather in Oslo?"},
            {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city":"Oslo"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"type": "message", "role": "assistant", "content": "Sunny."},
        ]
        assert validated({**GOOD, "input": kept})["input"] == turns
        assert (
            chat_body(continued({**GOOD, "input": "And tomorrow?"}, kept))["messages"]
            == chat_body({**GOOD, "input": [*given, {"role": "user", "content": "And tomorrow?"}]})["messages"]
        )

    def test_an_assistant_message_with_calls_keeps_both(self) -> None:
        given = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Looking."}, CALL]
        turns = validated({**GOOD, "input": given})["input"]
        assert [item["type"] for item in stored_items(turns)] == ["message", "message", "function_call"]
        assert validated({**GOOD, "input": stored_items(turns)})["input"] == turns


class StoredResponseApiTests:
    def test_its_account_reads_it_back_as_returned_and_deletes_it_once(self, customer, catalog) -> None:
        stored(customer, catalog, "resp_mine")
        read = call("get", customer.secret, "resp_mine")
        assert read.status_code == 200 and read.json() == {
            "id": "resp_mine",
            "object": "response",
            "output": [CALL],
            "store": True,
        }
        deleted = call("delete", customer.secret, "resp_mine")
        assert deleted.status_code == 200 and deleted.json() == {
            "id": "resp_mine",
            "object": "response",
            "deleted": True,
        }
        assert not StoredResponse.objects.exists() and Request.objects.filter(public_id="resp_mine").exists()
        assert_error(call("get", customer.secret, "resp_mine"), 404, "not_found")
        assert_error(call("delete", customer.secret, "resp_mine"), 404, "not_found")

    def test_another_account_gets_the_same_404_as_for_no_such_id_and_deletes_nothing(self, customer, catalog) -> None:
        stored(customer, catalog, "resp_mine")
        outsider = make_customer()
        theirs, unknown = call("get", outsider.secret, "resp_mine"), call("get", outsider.secret, "resp_nothing")
        assert assert_error(theirs, 404, "not_found")["param"] == "id"
        assert theirs.json()["error"]["message"].replace("resp_mine", "X") == unknown.json()["error"][
            "message"
        ].replace("resp_nothing", "X")
        assert_error(call("delete", outsider.secret, "resp_mine"), 404, "not_found")
        assert StoredResponse.objects.count() == 1

    def test_a_key_that_is_not_account_wide_reads_its_own_only_and_an_account_wide_one_reads_all(
        self, customer, catalog
    ) -> None:
        other_key = api_key_create(user=customer.user, name="second")
        wide_key = api_key_create(user=customer.user, name="wide", account_wide=True)
        stored(customer, catalog, "resp_first")
        assert_error(call("get", other_key.secret, "resp_first"), 404, "not_found")
        assert call("get", wide_key.secret, "resp_first").status_code == 200

    def test_an_expired_one_is_a_404_before_the_sweep_deletes_it(self, customer, catalog) -> None:
        stored(customer, catalog, "resp_old")
        StoredResponse.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
        assert_error(call("get", customer.secret, "resp_old"), 404, "not_found")

    def test_a_stranger_is_a_401(self, customer, catalog) -> None:
        stored(customer, catalog, "resp_mine")
        assert_error(call("get", "sk-nobody", "resp_mine"), 401, "invalid_api_key")
        assert_error(call("delete", "sk-nobody", "resp_mine"), 401, "invalid_api_key")
        assert StoredResponse.objects.count() == 1


class PreviousResponseTests:
    @pytest.mark.parametrize("whose", ["unknown", "outsider", "expired"])
    def test_an_id_this_key_cannot_read_is_a_404_naming_previous_response_id(self, customer, catalog, whose) -> None:
        stored(customer, catalog, "resp_mine")
        secret = make_customer().secret if whose == "outsider" else customer.secret
        if whose == "expired":
            StoredResponse.objects.update(expires_at=timezone.now())
        previous = "resp_nothing" if whose == "unknown" else "resp_mine"
        error = assert_error(
            post(Client(), secret, {**GOOD, "previous_response_id": previous}, path="/v1/responses"),
            404,
            "previous_response_not_found",
        )
        assert error["param"] == "previous_response_id" and error["type"] == "invalid_request_error"
        assert Request.objects.count() == 1  # nothing admitted

    @pytest.mark.parametrize("previous", ["resp_mine", 7])
    def test_a_stranger_is_a_401_before_any_look_up_or_check(self, customer, catalog, previous) -> None:
        stored(customer, catalog, "resp_mine")
        assert_error(
            post(Client(), "sk-nobody", {**GOOD, "previous_response_id": previous}, path="/v1/responses"),
            401,
            "invalid_api_key",
        )

    def test_a_bad_item_is_named_by_its_place_in_this_requests_own_input(self, customer, catalog) -> None:
        stored(customer, catalog, "resp_mine")  # two stored items come first
        body = {
            **GOOD,
            "previous_response_id": "resp_mine",
            "input": [{"role": "user", "content": "x"}, {"role": "bogus"}],
        }
        error = assert_error(post(Client(), customer.secret, body, path="/v1/responses"), 400, "invalid_value")
        assert error["param"] == "input[1].role" and "'input[1].role'" in error["message"]

    def test_a_previous_response_id_that_is_not_a_string_is_a_400(self, customer) -> None:
        error = assert_error(
            post(Client(), customer.secret, {**GOOD, "previous_response_id": 7}, path="/v1/responses"),
            400,
            "invalid_value",
        )
        assert error["param"] == "previous_response_id"


class SweepTests:
    def test_the_watchdog_task_deletes_expired_rows_and_keeps_live_ones(self, customer, catalog, settings) -> None:
        settings.RESPONSE_STORE_SECONDS = 60
        stored(customer, catalog, "resp_old")
        stored(customer, catalog, "resp_new")
        StoredResponse.objects.filter(request__public_id="resp_old").update(
            expires_at=timezone.now() - timedelta(seconds=1)
        )
        tasks.watchdog_tick()
        assert list(StoredResponse.objects.values_list("request__public_id", flat=True)) == ["resp_new"]
        assert Request.objects.filter(public_id="resp_old").exists()  # the bill stays
        assert stored_responses_expire() == 0

    def test_a_row_expires_after_the_setting(self, customer, catalog, settings) -> None:
        settings.RESPONSE_STORE_SECONDS = 5
        before = timezone.now()
        row = stored(customer, catalog, "resp_short")
        assert before + timedelta(seconds=5) <= row.expires_at <= timezone.now() + timedelta(seconds=5)


class StoredResponseAdminTests:
    def test_the_operator_sees_which_are_kept_and_until_when_never_the_conversation(self, customer, catalog) -> None:
        from django.contrib.auth import get_user_model

        row = stored(customer, catalog, "resp_admin")
        operator = Client()
        operator.force_login(get_user_model().objects.create_superuser("ops", "ops@example.com", "pw-long-enough"))
        pages = [
            operator.get("/admin/marketplace/storedresponse/?q=resp_admin"),
            operator.get(f"/admin/marketplace/storedresponse/{row.pk}/change/"),
        ]
        for page in pages:
            assert page.status_code == 200
            text = page.content.decode()
            assert "resp_admin" in text or str(row.request_id) in text
            assert "Weather in Oslo" not in text and "Oslo" not in text  # the customer's words stay out of the admin


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


def _answered_row(*, customer: Customer, catalog: CatalogModel, public_id: str) -> Request:
    with transaction.atomic():
        hold = hold_place(user=customer.user, api_key=customer.key, amount_ucents=0)
        return Request.objects.create(
            public_id=public_id,
            user=customer.user,
            api_key=customer.key,
            model=catalog,
            kind="chat",
            params={},
            hold=hold,
            status=Request.Status.COMPLETED,
            finish_reason="stop",
            prompt_tokens=9,
            completion_tokens=1,
        )


@pytest.fixture
def answered(customer: Customer, catalog: CatalogModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Admission and its host stood in for, so a test can take many turns fast: a body that passes
    the door's own checks (the store's bounds, then its translation and validation) is a request
    row of the customer's that has answered "Hello". What is refused before admission is tested
    with the real one."""

    async def admit(
        *, secret: str, body: dict, kind: str, translate: Callable[[dict], dict], new_id: Callable[[str], str]
    ) -> list[Admitted]:
        translate(body)
        row = await db(_answered_row, customer=customer, catalog=catalog, public_id=new_id(kind))
        return [Admitted(row=row, listener=_Listener(row), include_usage=True)]  # type: ignore[arg-type]

    monkeypatch.setattr("marketplace.openai.apis.admit_choices", admit)


def stored_bytes(row: StoredResponse) -> int:
    return len(json.dumps(row.conversation)) + len(json.dumps(row.body))


class StoredBoundsTests:
    """Issue 50: what a stored response keeps is bounded; over a limit is a 400 before anything
    is queued or billed; nothing saved once billed can fail."""

    def test_a_megabyte_junk_key_carried_over_fifty_turns_stays_bounded(self, customer, answered, settings) -> None:
        settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 2_000_000
        junk, previous, sizes = "j" * 1_000_000, None, []
        for turn in range(50):
            item = {"type": "message", "role": "user", "content": f"Turn {turn}", "junk": junk}
            body = {**GOOD, "input": [item], "store": True, **({"previous_response_id": previous} if previous else {})}
            response = post(Client(), customer.secret, body, path="/v1/responses")
            assert response.status_code == 200, response.content[:500]
            previous = response.json()["id"]
            row = StoredResponse.objects.get(request__public_id=previous)
            sizes.append(stored_bytes(row))
            assert sizes[-1] < 20_000, f"turn {turn} stored {sizes[-1]} bytes"
        assert len(row.conversation) == 100 and row.conversation[-2:] == [
            {"type": "message", "role": "user", "content": "Turn 49"},
            {"type": "message", "role": "assistant", "content": "Hello"},
        ]
        assert (
            sum(stored_bytes(row) for row in StoredResponse.objects.all()) < 500_000
        )  # 50 MB and more if the junk were kept
        assert StoredResponse.objects.get(request__public_id=previous).size_bytes > 0

    def test_a_nul_in_a_key_of_no_meaning_is_not_kept_and_the_answer_is_stored(self, customer, answered) -> None:
        item = {"role": "user", "content": "hi", "junk\x00": "a\x00b", "id": "\x00"}
        response = post(Client(), customer.secret, {**GOOD, "input": [item], "store": True}, path="/v1/responses")
        assert response.status_code == 200, response.content
        row = StoredResponse.objects.get(request__public_id=response.json()["id"])
        assert not holds_nul(row.conversation) and not holds_nul(row.body)
        assert row.conversation == [
            {"type": "message", "role": "user", "content": "hi"},
            {"type": "message", "role": "assistant", "content": "Hello"},
        ]
        assert call("get", customer.secret, response.json()["id"]).json() == response.json()

    def test_a_nul_in_an_echoed_field_is_a_400_before_anything_is_queued(self, customer, catalog, settings) -> None:
        settings.QUEUE_TIMEOUT_SECONDS = 0.5  # (were it queued: a quick 504, not this test's wait)
        body = {**GOOD, "store": True, "metadata": {"team\x00": "a"}}
        error = assert_error(post(Client(), customer.secret, body, path="/v1/responses"), 400, "invalid_value")
        assert error["param"] == "metadata" and not Request.objects.exists() and not Hold.objects.exists()

    def test_whatever_reaches_the_save_once_billed_is_stored_without_nul_or_lone_surrogates(
        self, customer, catalog
    ) -> None:
        with transaction.atomic():
            hold = hold_place(user=customer.user, api_key=customer.key, amount_ucents=0)
            request = Request.objects.create(
                public_id="resp_odd",
                user=customer.user,
                api_key=customer.key,
                model=catalog,
                kind="chat",
                params={},
                hold=hold,
            )
        message = {"type": "message", "content": [{"type": "output_text", "text": "a\x00b\ud800c"}]}
        row = stored_response_save(
            request_id=request.pk,
            kept=[{"type": "message", "role": "user", "content": "hi"}],
            response={"id": "resp_odd", "output": [message], "metadata": {"k\x00": "v"}},
        )
        row.refresh_from_db()
        assert row.conversation[-1] == {"type": "message", "role": "assistant", "content": "ab?c"}
        assert row.body["metadata"] == {"k": "v"} and not holds_nul(row.body)
        json.dumps(row.body).encode()  # (UTF-8 throughout: PostgreSQL's jsonb takes it)

    def test_over_one_responses_limit_is_a_400_naming_it_and_nothing_is_queued_or_billed(
        self, customer, catalog, settings
    ) -> None:
        settings.RESPONSE_STORE_MAX_BYTES = 2048
        body = {**GOOD, "input": "x" * 3000, "store": True}
        error = assert_error(
            post(Client(), customer.secret, body, path="/v1/responses"), 400, "stored_response_too_large"
        )
        assert error["param"] == "input" and "2048" in error["message"] and error["type"] == "invalid_request_error"
        assert not Request.objects.exists() and not Hold.objects.exists()
        assert (
            asyncio.run(stored_turn_admit(secret=customer.secret, body={**body, "store": False})) is None
        )  # not kept: no bound

    def test_a_continued_conversation_over_the_limit_is_refused_the_same_way(self, customer, catalog, settings) -> None:
        stored(customer, catalog, "resp_mine")
        settings.RESPONSE_STORE_MAX_BYTES = 1024
        body = {
            **GOOD,
            "input": [{"type": "function_call_output", "call_id": "call_1", "output": "y" * 900}],
            "previous_response_id": "resp_mine",
            "store": True,
        }
        assert_error(post(Client(), customer.secret, body, path="/v1/responses"), 400, "stored_response_too_large")
        assert Request.objects.count() == 1  # the stored one's only
        kept = asyncio.run(
            stored_turn_admit(
                secret=customer.secret,
                body=continued(
                    {**body, "input": [{**body["input"][0], "output": "sunny"}]},
                    StoredResponse.objects.get().conversation,
                ),
            )
        )
        assert kept is not None and kept[-1] == {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}

    def test_over_the_accounts_limit_is_a_400_and_expired_ones_do_not_count(self, customer, catalog, settings) -> None:
        settings.RESPONSE_STORE_ACCOUNT_MAX_BYTES = 10_000
        stored(customer, catalog, "resp_big")
        StoredResponse.objects.update(size_bytes=9_900)
        body = {**GOOD, "store": True}
        error = assert_error(post(Client(), customer.secret, body, path="/v1/responses"), 400, "response_store_full")
        assert error["param"] == "store" and "9900" in error["message"] and "10000" in error["message"]
        assert Request.objects.count() == 1 and Hold.objects.count() == 1  # the stored one's only
        other = make_customer()  # another account's store is its own
        assert asyncio.run(stored_turn_admit(secret=other.secret, body=body)) == [
            {"type": "message", "role": "user", "content": "Say hi"}
        ]
        StoredResponse.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
        assert asyncio.run(stored_turn_admit(secret=customer.secret, body=body)) is not None
