"""The MoE coordinator's model on a device (`mahout moe coordinator --device`, `engine.device`).

The whole model's tensors (attention, norms, routers, the experts it holds itself, the token
embedding and the output head) and its KV cache live on the device. It takes token ids,
positions and cache rows on the CPU and hands back its logits there, as a ring stage on a GPU
does (`engine.model.Stage`), so the runner's packing and picking, the host loop and the wire
stay as they are; the routed rows a remote worker computes cross to the CPU on their way out
and back to the device with its answer (`mahout.moe.coordinator.Coordinator`).
"""

from __future__ import annotations

import torch

from engine.model import KVCache, tensors_to_device
from engine.moe import MoeModel

__all__ = ["DeviceMoeModel", "on_device"]


class DeviceMoeModel:
    """`model` moved to `device` (in place), called as the model is."""

    def __init__(self, model: MoeModel, device: torch.device) -> None:
        self.model, self.device = model, device
        weights = model.weights
        for layer in weights.layers:
            tensors_to_device(layer, device)
            if layer.experts is not None:  # the same banks the coordinator computes local experts with
                layer.experts.to_device(device)
        tensors_to_device(weights, device)  # embedding, output norm, output head
        cache = model.cache
        model.cache = KVCache(
            model.config,
            len(weights.layers),
            cache.n_rows,
            cache.n_ctx,
            device=device,
        )

    @property
    def cache(self) -> KVCache:
        return self.model.cache

    def __call__(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache_rows: torch.Tensor,
        logits_for: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # tokens, positions, cache_rows: (T,) int64 on the CPU -> logits (T', V) on the CPU
        there = None if logits_for is None else logits_for.to(self.device)
        logits = self.model(tokens.to(self.device), positions.to(self.device), cache_rows.to(self.device), there)
        return logits.cpu()


def on_device(model: MoeModel, device: torch.device) -> MoeModel | DeviceMoeModel:
    """`model` where `device` says: itself on the CPU, else moved there."""
    return model if device.type == "cpu" else DeviceMoeModel(model, device)
