"""GET /v1/models: each served model with its card computed from its catalog entry (context,
OpenRouter's USD-per-token pricing, architecture) and the parameters its endpoint takes; a model
added from its own GGUF file shows its own (issue 28)."""

from __future__ import annotations

import pytest
from django.core.cache import cache
from django.test import Client

from catalog.models import CatalogModel
from catalog.services import catalog_model_add
from catalog.tests.test_catalog_add import TEMPLATE, _tiny_gguf
from conftest import make_host
from hosts.services import host_heartbeat, qualification_register
from marketplace.openai.serializers import UNSUPPORTED, ChatInputSerializer, EmbeddingsInputSerializer

pytestmark = pytest.mark.django_db

CHAT_ENDPOINT_TAKES = {
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "response_format",
    "logprobs",
    "top_logprobs",
    "n",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "stream",
    "stream_options",
    "provider",
    "models",
}


def serve(model: CatalogModel) -> None:
    """An online host that benchmarked `model`'s own file and has it loaded."""
    serving = make_host(qualified=False)
    qualification_register(
        host=serving.host,
        model_name=model.name,
        fingerprint=serving.fingerprint,
        machine={},
        benchmark={"prompt_tps": 500.0, "gen_tps": 40.0, "ttft_ms": 50.0, "memory_mb": 400.0},
        sha256=model.sha256,
    )
    catalog = {
        "installed": [model.name],
        "qualified": [model.name],
        "loaded": [model.name],
        "slots": 1,
        "active_jobs": 0,
    }
    host_heartbeat(
        host=serving.host, fingerprint=serving.fingerprint, paused=False, models_loaded=[], version="t", catalog=catalog
    )


def listed(secret: str) -> dict[str, dict]:
    cache.clear()  # the served list is cached at the heartbeat cadence
    response = Client().get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {secret}")
    assert response.status_code == 200 and response.json()["object"] == "list"
    return {entry["id"]: entry for entry in response.json()["data"]}


class ModelListTests:
    def test_it_lists_a_model_added_from_its_file_with_its_own_context_prices_and_architecture(
        self, customer, catalog, var_dir, tmp_path
    ) -> None:
        path = _tiny_gguf(tmp_path / "tiny.gguf", template=TEMPLATE, general_name="tiny chat")
        added = catalog_model_add(
            path=path, name="tiny-chat", input_price="0.15", output_price="0.60", context_length=2048
        )
        serve(added)
        serve(catalog)

        models = listed(customer.secret)

        entry = models["tiny-chat"]
        assert set(entry.pop("supported_parameters")) == CHAT_ENDPOINT_TAKES
        assert entry == {
            "id": "tiny-chat",
            "object": "model",
            "created": int(added.created_at.timestamp()),
            "owned_by": "elephant",
            "kind": "chat",
            "context_length": 2048,
            "pricing": {"prompt": "0.00000015", "completion": "0.0000006"},  # $0.15 and $0.60 per million tokens
            "architecture": {
                "modality": "text->text",
                "input_modalities": ["text"],
                "output_modalities": ["text"],
                "tokenizer": "gemma3",
                "instruct_type": "chat_template",
            },
            "hosts_online": 1,
            "hosts_warm": 1,
            "latency_critical": False,
        }
        shipped = models["gemma-3-270m"]
        assert shipped["context_length"] == catalog.context_length != 2048
        assert shipped["pricing"] != entry["pricing"]

    def test_a_price_is_the_entrys_exact_micro_cents_in_usd_per_token(self, customer, catalog) -> None:
        CatalogModel.objects.filter(pk=catalog.pk).update(input_price_ucents=1, output_price_ucents=123_456_789)
        serve(catalog)

        assert listed(customer.secret)["gemma-3-270m"]["pricing"] == {
            "prompt": "0.00000001",
            "completion": "1.23456789",
        }

    def test_the_embeddings_model_says_it_answers_vectors(self, customer, catalog) -> None:
        minilm = CatalogModel.objects.get(name="all-minilm-l6-v2")
        serve(minilm)

        entry = listed(customer.secret)["all-minilm-l6-v2"]
        assert entry["kind"] == "embedding" and entry["context_length"] == minilm.context_length
        assert entry["architecture"]["output_modalities"] == ["embeddings"]
        assert entry["supported_parameters"] == ["encoding_format", "user", "provider"]


class SupportedParametersTests:
    """Computed from the endpoints' input serializers: a field added there is listed, none is typed twice."""

    def test_a_chat_model_lists_every_field_the_chat_endpoint_takes_besides_model_and_messages(self) -> None:
        from marketplace.openai.apis import SUPPORTED_PARAMETERS_BY_KIND

        assert set(SUPPORTED_PARAMETERS_BY_KIND[CatalogModel.Kind.CHAT]) == CHAT_ENDPOINT_TAKES
        assert set(ChatInputSerializer().fields) == {*CHAT_ENDPOINT_TAKES, "model", "messages"}

    def test_what_the_gateway_refuses_by_name_is_not_listed(self) -> None:
        from marketplace.openai.apis import SUPPORTED_PARAMETERS_BY_KIND

        chat = set(SUPPORTED_PARAMETERS_BY_KIND[CatalogModel.Kind.CHAT])
        assert {"logit_bias", "presence_penalty", "frequency_penalty", "functions", "echo"} <= set(UNSUPPORTED) - chat

    def test_an_embeddings_model_lists_what_embeddings_take_but_not_dimensions_which_is_refused(self) -> None:
        from marketplace.openai.apis import SUPPORTED_PARAMETERS_BY_KIND

        assert SUPPORTED_PARAMETERS_BY_KIND[CatalogModel.Kind.EMBEDDING] == ["encoding_format", "user", "provider"]
        assert "dimensions" in EmbeddingsInputSerializer().fields
