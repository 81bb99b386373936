"""Elephant's inference engine: a Gemma 3 transformer read from GGUF that can run
any contiguous slice of layers (a ring *stage*) with its own KV cache.

`engine` never imports Django: a host installs it without the gateway.
"""

from __future__ import annotations

from engine.model import Config, ContextOverflowError, KVCache, LayerWeights, RowSpan, Stage, StageWeights

__all__ = ["Config", "ContextOverflowError", "KVCache", "LayerWeights", "RowSpan", "Stage", "StageWeights"]
