"""Elephant's inference engine: a dense transformer read from GGUF (Gemma 3, Llama 3.x and
Mistral, Qwen 2.5, Qwen 3: `engine.arch`) that can run any contiguous slice of layers (a ring
*stage*) with its own KV cache.

`engine` never imports Django: a host installs it without the gateway.
"""

from __future__ import annotations

__all__ = ["Config", "ContextOverflowError", "KVCache", "LayerWeights", "RowSpan", "Stage", "StageWeights"]


def __getattr__(name: str) -> object:
    """The model's names, imported on first use: `engine.shipped` must not pull in torch."""
    if name in __all__:
        from engine import model

        return getattr(model, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
