"""What an OpenAI client sends means what it says (issue 18, first part): a parameter that
would change the answer and that no host honours is refused by name instead of silently
ignored; harmless ones are accepted; every response carries a request id; a 429 says when
to retry."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from accounts.models import ApiKey
from marketplace.models import Request
from marketplace.tests.test_apis import GOOD, assert_error, post

pytestmark = pytest.mark.django_db(
    transaction=True
)  # the API views are async: their database threads must see the rows


@pytest.fixture
def api(customer) -> tuple[Client, str]:  # noqa: ANN001
    return Client(), customer.secret


REFUSED = [
    ("logit_bias", {"50256": -100}),
    ("presence_penalty", 0.5),
    ("frequency_penalty", 1.0),
    ("functions", [{"name": "f"}]),
    ("function_call", "auto"),
]
HARMLESS = [
    ("response_format", {"type": "text"}),
    ("tools", []),
    ("tool_choice", "none"),
    ("logprobs", False),
    ("n", 1),
    ("presence_penalty", 0),
    ("user", "u-42"),
    ("metadata", {"team": "a"}),
    ("store", False),
    ("service_tier", "auto"),
]


class UnsupportedParameterTests:
    @pytest.mark.parametrize(("name", "value"), REFUSED)
    def test_a_parameter_that_would_be_ignored_is_refused_by_name(self, api, name, value) -> None:
        client, secret = api
        error = assert_error(post(client, secret, {**GOOD, name: value}), 400, "unsupported_parameter")
        assert error["param"] == name and f"'{name}'" in error["message"]
        assert not Request.objects.exists()

    @pytest.mark.parametrize(("name", "value"), HARMLESS)
    def test_a_value_that_changes_nothing_is_accepted(self, api, name, value) -> None:
        client, secret = api
        response = post(
            client, secret, {**GOOD, "model": "gpt-9", name: value}
        )  # past validation: the unknown model answers
        assert_error(response, 404, "model_not_found")

    def test_completions_refuse_echo_suffix_and_best_of(self, api) -> None:
        client, secret = api
        body = {"model": "gemma-3-270m", "prompt": "Once", "max_tokens": 4}
        for name, value in (
            ("echo", True),
            ("suffix", "end."),
            ("best_of", 3),
            ("tools", [{"type": "function", "function": {"name": "f"}}]),
            ("tool_choice", "required"),
        ):
            assert_error(
                post(client, secret, {**body, name: value}, path="/v1/completions"), 400, "unsupported_parameter"
            )

    def test_a_models_entry_names_its_supported_parameters(self, catalog) -> None:
        from marketplace.openai.apis import model_body
        from marketplace.selectors import ServedModel

        entry = model_body(ServedModel(model=catalog, hosts_online=1, hosts_warm=1))
        assert {"temperature", "tools", "logprobs", "n"} <= set(entry["supported_parameters"])
        assert "logit_bias" not in entry["supported_parameters"]

    def test_an_embeddings_entry_names_only_what_embeddings_take(self, catalog) -> None:
        from catalog.models import CatalogModel
        from marketplace.openai.apis import model_body
        from marketplace.selectors import ServedModel

        embeddings = CatalogModel.objects.get(name="all-minilm-l6-v2")
        entry = model_body(ServedModel(model=embeddings, hosts_online=1, hosts_warm=1))
        assert entry["supported_parameters"] == ["encoding_format", "user", "provider"]


class ModelKindTests:
    """/v1/models lists chat and embeddings models side by side: a request sent to the wrong
    endpoint for its model is told which endpoint serves it, not that the model does not exist."""

    def test_a_chat_request_to_an_embeddings_model_is_sent_to_the_embeddings_endpoint(self, api, catalog) -> None:
        client, secret = api
        for path, body in (
            ("/v1/chat/completions", {**GOOD, "model": "all-minilm-l6-v2"}),
            ("/v1/completions", {"model": "all-minilm-l6-v2", "prompt": "Once", "max_tokens": 4}),
        ):
            error = assert_error(post(client, secret, body, path=path), 400, "wrong_model_kind")
            assert error["type"] == "invalid_request_error" and error["param"] == "model"
            assert (
                "'all-minilm-l6-v2' is an embeddings model" in error["message"]
                and "POST /v1/embeddings" in error["message"]
            )
            assert "does not exist" not in error["message"]
        assert not Request.objects.exists()

    def test_an_embeddings_request_to_a_chat_model_is_sent_to_the_chat_endpoint(self, api, catalog) -> None:
        client, secret = api
        error = assert_error(
            post(client, secret, {"model": "gemma-3-270m", "input": "hi"}, path="/v1/embeddings"),
            400,
            "wrong_model_kind",
        )
        assert "'gemma-3-270m' is a chat model" in error["message"] and "POST /v1/chat/completions" in error["message"]
        assert not Request.objects.exists()

    def test_an_embeddings_model_among_the_fallbacks_names_the_fallbacks(self, api, catalog) -> None:
        client, secret = api
        error = assert_error(post(client, secret, {**GOOD, "models": ["all-minilm-l6-v2"]}), 400, "wrong_model_kind")
        assert error["param"] == "models"

    def test_a_model_nobody_lists_is_still_a_404(self, api, catalog) -> None:
        client, secret = api
        assert (
            "does not exist"
            in assert_error(
                post(client, secret, {"model": "gpt-9", "input": "hi"}, path="/v1/embeddings"), 404, "model_not_found"
            )["message"]
        )


class HeaderTests:
    def test_every_response_has_a_request_id_and_echoes_the_clients(self, api) -> None:
        client, secret = api
        response = client.post(
            "/v1/chat/completions",
            data=json.dumps({**GOOD, "n": 2, "stream": True}),
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {secret}",
            HTTP_X_CLIENT_REQUEST_ID="my-trace-7",
        )
        assert response["x-request-id"].startswith("req_") and response["x-client-request-id"] == "my-trace-7"
        assert int(response["openai-processing-ms"]) >= 0
        other = Client().get("/v1/models")
        assert other["x-request-id"] != response["x-request-id"] and "x-client-request-id" not in other

    @pytest.mark.django_db(transaction=True)
    def test_a_rate_limited_key_reads_its_limit_and_is_told_when_to_retry(self, customer, catalog) -> None:
        ApiKey.objects.filter(pk=customer.key.pk).update(rate_limit_per_minute=2)
        client = Client()
        body = {**GOOD, "model": "gemma-3-270m", "max_tokens": 1, "stream": True}
        answers = [
            client.post(
                "/v1/chat/completions",
                data=json.dumps(body),
                content_type="application/json",
                HTTP_AUTHORIZATION=f"Bearer {customer.secret}",
            )
            for _ in range(2)
        ]
        assert [a.status_code for a in answers] == [200, 200]
        assert [a["x-ratelimit-remaining-requests"] for a in answers] == ["1", "0"]
        assert {a["x-ratelimit-limit-requests"] for a in answers} == {"2"}
        assert 58 <= int(answers[0]["x-ratelimit-reset-requests"].removesuffix("s")) <= 60
        refused = post(client, customer.secret, body)
        assert_error(refused, 429, "rate_limited")
        assert refused["x-ratelimit-remaining-requests"] == "0" and refused["x-ratelimit-limit-requests"] == "2"
        assert 1 <= int(refused["Retry-After"]) <= 60  # when the oldest admission leaves the minute
        assert refused["Retry-After"] + "s" == refused["x-ratelimit-reset-requests"]

    def test_a_key_without_a_limit_gets_no_rate_limit_headers(self, customer, catalog) -> None:
        response = Client().post(
            "/v1/chat/completions",
            data=json.dumps({**GOOD, "model": "gemma-3-270m", "max_tokens": 1, "stream": True}),
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {customer.secret}",
        )
        assert response.status_code == 200 and "x-ratelimit-limit-requests" not in response
