from __future__ import annotations

import pytest

from catalog.models import CatalogModel
from catalog.money import usd_per_token
from catalog.selectors import catalog_model_card

pytestmark = pytest.mark.django_db


class UsdPerTokenTests:
    @pytest.mark.parametrize(
        ("ucents", "written"),
        [(0, "0"), (10, "0.0000001"), (150, "0.0000015"), (123_456_789, "1.23456789"), (100_000_000, "1")],
    )
    def test_it_writes_a_per_token_price_in_exact_usd(self, ucents: int, written: str) -> None:
        assert usd_per_token(ucents) == written


class CatalogModelCardTests:
    def test_it_computes_a_chat_models_listing_from_its_entry(self) -> None:
        model = CatalogModel(
            name="m",
            kind=CatalogModel.Kind.CHAT,
            context_length=2048,
            input_price_ucents=10,
            output_price_ucents=40,
            architecture="llama",
            chat_template="{{ messages }}",
        )

        assert catalog_model_card(model) == {
            "context_length": 2048,
            "pricing": {"prompt": "0.0000001", "completion": "0.0000004"},
            "architecture": {
                "modality": "text->text",
                "input_modalities": ["text"],
                "output_modalities": ["text"],
                "tokenizer": "llama",
                "instruct_type": "chat_template",
            },
        }

    def test_a_chat_models_listing_says_no_more_context_than_audits_read(self) -> None:
        model = CatalogModel(
            name="m", kind=CatalogModel.Kind.CHAT, context_length=32768, input_price_ucents=10, output_price_ucents=40
        )

        assert catalog_model_card(model)["context_length"] == 4096  # what is sold: a longer job could not be audited

    def test_it_says_an_embeddings_model_answers_vectors(self) -> None:
        card = catalog_model_card(CatalogModel.objects.get(name="all-minilm-l6-v2"))

        assert card["architecture"]["output_modalities"] == ["embeddings"]
        assert card["pricing"] == {"prompt": "0.00000002", "completion": "0"}
