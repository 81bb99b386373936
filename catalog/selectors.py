"""Reads of the catalog."""

from __future__ import annotations

from typing import Any

from catalog.models import CatalogModel
from catalog.money import usd_per_token


def catalog_model_by_name(*, name: str) -> CatalogModel | None:
    """The active catalog entry of that name, or None."""
    return CatalogModel.objects.filter(name=name, active=True).first()


def catalog_models() -> list[CatalogModel]:
    return list(CatalogModel.objects.filter(active=True).order_by("name"))


def catalog_model_card(model: CatalogModel) -> dict[str, Any]:
    """What a listing says of a model, computed from its entry (OpenRouter's shapes): its context,
    its prices in USD per token, and its architecture as its file names it ("" where the entry was
    not made from a file). The API adds what only it knows (hosts, supported parameters)."""
    output = "embeddings" if model.kind == CatalogModel.Kind.EMBEDDING else "text"
    return {
        "context_length": model.context_sold,
        "pricing": {
            "prompt": usd_per_token(model.input_price_ucents),
            "completion": usd_per_token(model.output_price_ucents),
        },
        "architecture": {
            "modality": f"text->{output}",
            "input_modalities": ["text"],
            "output_modalities": [output],
            "tokenizer": model.architecture,
            "instruct_type": "chat_template" if model.chat_template else None,
        },
    }
