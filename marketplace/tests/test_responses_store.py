"""Stored responses (issue 34): `store: true` keeps a Response and its conversation for
RESPONSE_STORE_SECONDS, read, continued and deleted only by its account, then deleted by the
watchdog's sweep. The same through the `openai` package against a real gateway and host:
test_responses_store_e2e.py."""
from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

import pytest
from django.db import transaction
from django.test import Client
from django.utils import timezone

from accounts.services import api_key_create
from billing.services import hold_place
from conftest import make_customer
from marketplace import tasks
from marketplace.models import Request, StoredResponse
from marketplace.responses import chat_body, continued, conversation_after
from marketplace.stored_responses import stored_response_save, stored_responses_expire
from marketplace.tests.test_apis import assert_error, post

if TYPE_CHECKING:
    from catalog.models import CatalogModel
    from testkit.personas import Customer

pytestmark = pytest.mark.django_db(transaction=True)  # the API views are async: their database threads must see the rows

GOOD = {"model": "gemma-3-270m", "input": "Say hi", "max_output_tokens": 8}
CALL = {"id": "fc_1", "type": "function_call", "status": "completed", "call_id": "call_1", "name": "weather",
        "arguments": '{"city":"Oslo"}'}
EARLIER = [{"type": "message", "role": "user", "content": "Weather in Oslo?"}, CALL]


def stored(customer: Customer, catalog: CatalogModel, public_id: str, *, key: object = None) -> StoredResponse:
    """A request of `customer`'s (made with `key`, its first key unless told) whose response is stored."""
    key = key or customer.key
    with transaction.atomic():
        hold = hold_place(user=customer.user, api_key=key, amount_ucents=0)
        row = Request.objects.create(public_id=public_id, user=customer.user, api_key=key, model=catalog, kind="chat",
                                     params={}, hold=hold)
    body = {"id": public_id, "object": "response", "output": [CALL], "store": True}
    return stored_response_save(request_id=row.pk, conversation=conversation_after({"input": EARLIER[:1]}, body), body=body)


def call(method: str, secret: str, response_id: str) -> object:
    return getattr(Client(), method)(f"/v1/responses/{response_id}", HTTP_AUTHORIZATION=f"Bearer {secret}")


class ConversationTests:
    def test_the_stored_items_come_before_this_turns_input_and_only_its_instructions_count(self) -> None:
        body = continued({**GOOD, "instructions": "Be brief.",
                          "input": [{"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]}, EARLIER)
        assert chat_body(body)["messages"] == [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]

    def test_a_string_input_is_one_more_user_message_and_a_bad_input_is_left_to_validation(self) -> None:
        assert continued(GOOD, EARLIER)["input"] == [*EARLIER, {"type": "message", "role": "user", "content": "Say hi"}]
        assert continued({**GOOD, "input": 5}, EARLIER)["input"] == 5

    def test_what_is_kept_is_the_input_then_the_output(self) -> None:
        assert conversation_after({"input": "Hi"}, {"output": [CALL]}) == [
            {"type": "message", "role": "user", "content": "Hi"}, CALL]


class StoredResponseApiTests:
    def test_its_account_reads_it_back_as_returned_and_deletes_it_once(self, customer, catalog) -> None:
        stored(customer, catalog, "resp_mine")
        read = call("get", customer.secret, "resp_mine")
        assert read.status_code == 200 and read.json() == {"id": "resp_mine", "object": "response", "output": [CALL],
                                                           "store": True}
        deleted = call("delete", customer.secret, "resp_mine")
        assert deleted.status_code == 200 and deleted.json() == {"id": "resp_mine", "object": "response", "deleted": True}
        assert not StoredResponse.objects.exists() and Request.objects.filter(public_id="resp_mine").exists()
        assert_error(call("get", customer.secret, "resp_mine"), 404, "not_found")
        assert_error(call("delete", customer.secret, "resp_mine"), 404, "not_found")

    def test_another_account_gets_the_same_404_as_for_no_such_id_and_deletes_nothing(self, customer, catalog) -> None:
        stored(customer, catalog, "resp_mine")
        outsider = make_customer()
        theirs, unknown = call("get", outsider.secret, "resp_mine"), call("get", outsider.secret, "resp_nothing")
        assert assert_error(theirs, 404, "not_found")["param"] == "id"
        assert theirs.json()["error"]["message"].replace("resp_mine", "X") == \
            unknown.json()["error"]["message"].replace("resp_nothing", "X")
        assert_error(call("delete", outsider.secret, "resp_mine"), 404, "not_found")
        assert StoredResponse.objects.count() == 1

    def test_a_key_that_is_not_account_wide_reads_its_own_only_and_an_account_wide_one_reads_all(self, customer, catalog) -> None:
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
        error = assert_error(post(Client(), secret, {**GOOD, "previous_response_id": previous}, path="/v1/responses"),
                             404, "previous_response_not_found")
        assert error["param"] == "previous_response_id" and error["type"] == "invalid_request_error"
        assert Request.objects.count() == 1  # nothing admitted

    @pytest.mark.parametrize("previous", ["resp_mine", 7])
    def test_a_stranger_is_a_401_before_any_look_up_or_check(self, customer, catalog, previous) -> None:
        stored(customer, catalog, "resp_mine")
        assert_error(post(Client(), "sk-nobody", {**GOOD, "previous_response_id": previous}, path="/v1/responses"),
                     401, "invalid_api_key")

    def test_a_bad_item_is_named_by_its_place_in_this_requests_own_input(self, customer, catalog) -> None:
        stored(customer, catalog, "resp_mine")  # two stored items come first
        body = {**GOOD, "previous_response_id": "resp_mine", "input": [{"role": "user", "content": "x"}, {"role": "bogus"}]}
        error = assert_error(post(Client(), customer.secret, body, path="/v1/responses"), 400, "invalid_value")
        assert error["param"] == "input[1].role" and "'input[1].role'" in error["message"]

    def test_a_previous_response_id_that_is_not_a_string_is_a_400(self, customer) -> None:
        error = assert_error(post(Client(), customer.secret, {**GOOD, "previous_response_id": 7}, path="/v1/responses"),
                             400, "invalid_value")
        assert error["param"] == "previous_response_id"


class SweepTests:
    def test_the_watchdog_task_deletes_expired_rows_and_keeps_live_ones(self, customer, catalog, settings) -> None:
        settings.RESPONSE_STORE_SECONDS = 60
        stored(customer, catalog, "resp_old")
        stored(customer, catalog, "resp_new")
        StoredResponse.objects.filter(request__public_id="resp_old").update(expires_at=timezone.now() - timedelta(seconds=1))
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
        pages = [operator.get("/admin/marketplace/storedresponse/?q=resp_admin"),
                 operator.get(f"/admin/marketplace/storedresponse/{row.pk}/change/")]
        for page in pages:
            assert page.status_code == 200
            text = page.content.decode()
            assert "resp_admin" in text or str(row.request_id) in text
            assert "Weather in Oslo" not in text and "Oslo" not in text  # the customer's words stay out of the admin
