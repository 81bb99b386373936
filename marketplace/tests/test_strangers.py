"""Strangers get nothing done for them (issue 30): the key is looked up before the body is
validated, so a schema that would cost seconds of grammar building is a 401 for a bad key at
every door; and a body nested deeper than any reader can walk is a 400, not a 500."""

from __future__ import annotations

import asyncio
import json

import pytest
import websockets
from django.test import Client

from accounts.services import api_key_revoke
from core.errors import DomainError
from core.parsers import MAX_JSON_DEPTH, TooDeep, json_depth, json_loads
from marketplace.lifecycle import structured
from marketplace.models import Request
from marketplace.openai.choices import admit_choices
from marketplace.openai.serializers import ChatInputSerializer, CompletionInputSerializer, EmbeddingsInputSerializer
from marketplace.tests.test_apis import assert_error, post

pytestmark = pytest.mark.django_db(transaction=True)  # views run ORM calls on their own threads

# The measured attack: 2.5 s of CPU and 170 MB of grammar for anyone holding any bearer string.
HUGE = {
    "type": "json_schema",
    "json_schema": {"name": "many", "schema": {"type": "array", "items": {"type": "string"}, "minItems": 10_000_000}},
}
CHAT = {
    "model": "gemma-3-270m",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 8,
    "response_format": HUGE,
}
DOORS = [
    ("/v1/chat/completions", CHAT),
    ("/v1/completions", {"model": "gemma-3-270m", "prompt": "Once", "max_tokens": 8, "response_format": HUGE}),
    ("/v1/embeddings", {"model": "all-minilm-l6-v2", "input": ["a cat"]}),
]


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.fixture
def nothing_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any validation of a generation body, or any grammar built from its schemas, fails the test."""

    def parsed(*args: object, **kwargs: object) -> None:
        raise AssertionError("the body was validated before the key was authenticated")

    monkeypatch.setattr(structured, "schema_problem", parsed)
    for serializer in (ChatInputSerializer, CompletionInputSerializer, EmbeddingsInputSerializer):
        monkeypatch.setattr(serializer, "is_valid", parsed)


class AuthenticateFirstTests:
    @pytest.mark.parametrize(("path", "body"), DOORS)
    def test_it_answers_a_bad_key_with_a_401_before_reading_the_schema(
        self, catalog, nothing_parsed, path, body
    ) -> None:
        assert_error(post(Client(), "x", body, path=path), 401, "invalid_api_key")

    def test_it_answers_a_revoked_key_with_a_401_even_for_an_invalid_body(self, customer) -> None:
        api_key_revoke(key=customer.key)
        assert_error(post(Client(), customer.secret, {**CHAT, "max_tokens": -1}), 401, "invalid_api_key")

    def test_it_still_validates_the_schema_for_a_good_key(self, customer, monkeypatch) -> None:
        monkeypatch.setattr(structured, "schema_problem", lambda schema: "minItems is past the limit")
        error = assert_error(post(Client(), customer.secret, CHAT), 400, "invalid_value")
        assert error["param"] == "response_format" and "minItems" in error["message"]

    def test_the_host_doors_authenticate_before_validating_too(self, catalog) -> None:
        response = Client().post(
            "/hosts/api/claim",
            data=json.dumps({"models": "x" * 1000, "wait": -1}),
            content_type="application/json",
            HTTP_AUTHORIZATION="Bearer x",
        )
        assert response.status_code == 401, response.content

    def test_the_socket_door_authenticates_each_message_before_validating_it(self, catalog, nothing_parsed) -> None:
        """The chat WebSocket checked the key at the handshake; a key revoked since then is
        refused by `admit_choices` itself, before the body is touched."""
        with pytest.raises(DomainError) as refused:
            asyncio.run(admit_choices(secret="el-nope", body=CHAT, kind=Request.Kind.CHAT))
        assert refused.value.status == 401


class NestedJsonTests:
    def test_a_body_nested_100000_deep_is_a_400_in_the_api_format(self, customer) -> None:
        error = assert_error(
            post(Client(), customer.secret, None, raw=f'{{"model": {nested(100_000)}}}'.encode()), 400, "invalid_json"
        )
        assert str(MAX_JSON_DEPTH) in error["message"]

    def test_a_body_just_past_the_depth_limit_is_refused_and_one_at_it_is_read(self, customer) -> None:
        too_deep = {**CHAT, "response_format": None, "metadata": json.loads(nested(MAX_JSON_DEPTH))}
        assert_error(post(Client(), customer.secret, too_deep), 400, "invalid_json")
        at_limit = {
            **CHAT,
            "response_format": None,
            "max_tokens": -1,
            "metadata": json.loads(nested(MAX_JSON_DEPTH - 1)),
        }
        assert_error(post(Client(), customer.secret, at_limit), 400, "invalid_value")  # read, then refused by a field

    @pytest.mark.parametrize("path", ["/hosts/api/claim", "/hosts/api/heartbeat"])  # (a view of ours, a DRF view)
    def test_the_host_doors_share_the_reader(self, serving_host, path) -> None:
        response = Client().post(
            path,
            data=nested(100_000),
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {serving_host.token}",
        )
        assert response.status_code == 400, response.content
        assert "nest more than" in response.json()["error"]["message"]

    def test_the_reader_counts_depth_without_recursing(self) -> None:
        assert json_depth(1) == 0 and json_depth([]) == 1 and json_depth({"a": [{"b": []}]}) == 4
        assert json_depth(json.loads(nested(500))) == 500
        with pytest.raises(TooDeep):
            json_loads(nested(100_000))
        with pytest.raises(TooDeep):
            json_loads(nested(MAX_JSON_DEPTH + 1))


@pytest.mark.e2e
class SocketStrangerTests:
    def test_a_key_revoked_after_the_handshake_is_refused_before_its_body_is_read(self, gateway, catalog) -> None:
        """On the real server: the body is invalid too, and the answer is still the key's 401."""
        from marketplace.tests.test_chat_socket import url
        from testkit.personas import make_customer

        customer = make_customer()

        async def talk() -> list[dict]:
            async with websockets.connect(
                url(gateway), additional_headers={"Authorization": f"Bearer {customer.secret}"}
            ) as ws:
                await asyncio.to_thread(api_key_revoke, key=customer.key)
                await ws.send(json.dumps({**CHAT, "max_tokens": -1}))
                return [json.loads(answer) async for answer in ws]

        answers = asyncio.run(talk())
        assert [answer["error"]["code"] for answer in answers] == ["invalid_api_key"]

    def test_a_socket_message_nested_100000_deep_is_refused_as_not_json(self, gateway, catalog) -> None:
        from marketplace.tests.test_chat_socket import exchange
        from testkit.personas import make_customer

        customer = make_customer()
        answers = exchange(
            gateway, [nested(100_000)], additional_headers={"Authorization": f"Bearer {customer.secret}"}
        )
        assert [answer["error"]["code"] for answer in answers] == ["invalid_json"]
