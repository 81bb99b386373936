"""A mixture-of-experts transformer (llama.cpp's `qwen3moe` layout, and Mixtral's: `llama`
blocks with routed experts) whose routed experts can be computed anywhere: locally, or by
remote expert workers that hold a slice of them.

Three plain things, as in `engine.model`: `MoeConfig` (the blueprint from GGUF metadata,
defined with its reader in the torch-free `engine.moe_gguf` and re-exported here),
weights per layer (`MoeLayerWeights`: attention, the router, and the layer's experts in an
`ExpertBank`), and a `KVCache` allocated up front and written at `pos`.

The feed-forward of every layer is routed: the router scores each token against all E
experts (softmax or sigmoid, as the file's `expert_gating_func` says; qwen3moe is softmax),
keeps the top K, renormalises their weights to sum to one, and adds the weighted outputs
of those K experts. Experts are asked for through an `ExpertCompute`: one call per layer
with the rows each chosen expert must process, so a coordinator can send one message per
worker per layer and compute the rest itself.

Shapes: T = tokens in the packed batch, D = d_model, H = query heads, KV = key/value heads,
Hd = head_dim, E = experts, K = experts used per token, F = expert ffn dim, V = vocab.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.model import AttentionWeights, KVCache, cached_attention, linear, qkv, rms_norm
from engine.moe_gguf import Gating, MoeConfig

__all__ = [
    "ExpertBank",
    "ExpertCompute",
    "Gating",
    "LocalExperts",
    "MoeConfig",
    "MoeLayerWeights",
    "MoeModel",
    "MoeWeights",
    "moe_ffn",
    "route",
]


class ExpertBank:
    """Experts [first, first + count) of one layer, as stacked matrices (out, in), kept in
    `engine.model.WEIGHT_DTYPE` by the loader and multiplied by `engine.model.linear`, as the
    dense engine's are (half the bytes a decode reads; the same numerics wherever a row runs)."""

    def __init__(self, layer: int, first: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        if not gate.shape == up.shape or gate.shape[0] != down.shape[0] or gate.shape[1:] != down.shape[:0:-1]:
            shapes = f"gate {tuple(gate.shape)}, up {tuple(up.shape)}, down {tuple(down.shape)}"
            raise ValueError(f"expert shapes do not agree: {shapes}")
        self.layer = layer
        self.first = first
        self.gate = gate  # (n, F, D)
        self.up = up  # (n, F, D)
        self.down = down  # (n, D, F)

    @property
    def count(self) -> int:
        return int(self.gate.shape[0])

    def holds(self, expert: int) -> bool:
        return self.first <= expert < self.first + self.count

    def to_device(self, device: torch.device) -> ExpertBank:
        """Keep the experts' matrices on `device` (a worker's GPU, see `engine.device`);
        inputs and results stay on the CPU, where the wire takes them."""
        self.gate, self.up, self.down = self.gate.to(device), self.up.to(device), self.down.to(device)
        return self

    def compute(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU expert: down(silu(gate x) * up x)."""
        # x: (N, D) -> (N, D)
        if not self.holds(expert):
            raise KeyError(f"expert {expert} of layer {self.layer} is not in [{self.first}, {self.first + self.count})")
        i = expert - self.first
        device = self.gate.device
        on = x if x.device == device else x.to(device)
        hidden = torch.nn.functional.silu(linear(on, self.gate[i])) * linear(on, self.up[i])  # (N, F)
        out = linear(hidden, self.down[i])  # (N, D)
        return out if out.device == x.device else out.to(x.device)

    def compute_many(self, inputs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        return {expert: self.compute(expert, x) for expert, x in inputs.items()}


class ExpertCompute(Protocol):
    """Computes routed experts of one layer: {expert: rows (N, D)} -> {expert: outputs (N, D)}."""

    def __call__(self, layer: int, inputs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]: ...


@dataclass
class MoeLayerWeights(AttentionWeights):
    """One block: `engine.model`'s attention, then the routed feed-forward (no post-norms)."""

    ffn_norm: torch.Tensor  # (D,)
    router: torch.Tensor  # (E, D)
    experts: ExpertBank | None  # all E experts, or None when they live elsewhere


@dataclass
class MoeWeights:
    layers: list[MoeLayerWeights]
    embedding: torch.Tensor  # (V, D)
    output_norm: torch.Tensor  # (D,)
    output: torch.Tensor  # (V, D)
    names: frozenset[str] = field(default_factory=frozenset)  # GGUF tensors read


class LocalExperts:
    """`ExpertCompute` over the experts held in this process's weights."""

    def __init__(self, banks: dict[int, ExpertBank]) -> None:
        self.banks = banks  # layer -> bank

    def __call__(self, layer: int, inputs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        return self.banks[layer].compute_many(inputs)


def route(x: torch.Tensor, router: torch.Tensor, config: MoeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K gating: (weights (T, K), expert ids (T, K)) for the normed hidden state x (T, D)."""
    logits = x @ router.T  # (T, E)
    scores = torch.softmax(logits, dim=-1) if config.gating == Gating.SOFTMAX else torch.sigmoid(logits)  # (T, E)
    weights, ids = torch.topk(scores, config.n_experts_used, dim=-1)  # (T, K) each
    if config.norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_ffn(x: torch.Tensor, layer: MoeLayerWeights, config: MoeConfig, experts: ExpertCompute) -> torch.Tensor:
    """The routed feed-forward: each token's K experts, weighted; one `experts` call per layer."""
    # x: (T, D) normed -> (T, D)
    weights, ids = route(x, layer.router, config)  # (T, K), (T, K)
    chosen = sorted(ids.unique().tolist())
    rows_of = {e: (ids == e).nonzero() for e in chosen}  # e -> (N_e, 2) of (token, slot)
    outputs = experts(layer.index, {e: x[rows_of[e][:, 0]] for e in chosen})  # e -> (N_e, D)
    out = torch.zeros_like(x)  # (T, D)
    for e in chosen:  # ascending expert order: the same sum order wherever experts ran
        token, slot = rows_of[e][:, 0], rows_of[e][:, 1]
        out.index_add_(0, token, outputs[e] * weights[token, slot].unsqueeze(1))
    return out


class MoeModel:
    """The whole MoE model with its KV cache; routed experts go through `experts`
    (default: the banks in `weights`)."""

    def __init__(
        self,
        config: MoeConfig,
        weights: MoeWeights,
        *,
        experts: ExpertCompute | None = None,
        n_rows: int = 4,
        n_ctx: int = 256,
    ) -> None:
        self.config = config
        self.weights = weights
        if experts is None:
            banks = {w.index: w.experts for w in weights.layers if w.experts is not None}
            if len(banks) != config.n_layers:
                raise ValueError("these weights hold no experts; pass an ExpertCompute")
            experts = LocalExperts(banks)
        self.experts = experts
        self.cache = KVCache(config, config.n_layers, n_rows, n_ctx)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache_rows: torch.Tensor,
        logits_for: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # tokens, positions, cache_rows: (T,) int64 -> logits (T', V)
        self.cache.check(positions, cache_rows)
        c = self.config
        h = self.weights.embedding[tokens].float()  # (T, D)
        for layer in self.weights.layers:
            h = h + self._attention(layer, rms_norm(h, layer.attn_norm, c.rms_eps), positions, cache_rows)  # (T, D)
            h = h + moe_ffn(rms_norm(h, layer.ffn_norm, c.rms_eps), layer, c, self.experts)  # (T, D)
        if logits_for is not None:
            h = h[logits_for]  # (T', D)
        return linear(rms_norm(h, self.weights.output_norm, c.rms_eps), self.weights.output)  # (T', V)

    __call__ = forward

    def _attention(
        self, w: MoeLayerWeights, x: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        """`engine.model`'s attention: q/k norms where the block has them, RoPE in the
        architecture's form (linearly scaled where the file says so)."""
        c = self.config
        q, k, v = qkv(w, x, positions, c, rope_base=c.rope_base, rope_scale=c.rope_scale, neox=c.rope_neox)
        out = cached_attention(self.cache, w.index, q, k, v, positions, rows, scale=c.attn_scale)  # (T, H, Hd)
        return linear(out.view(x.shape[0], c.n_heads * c.head_dim), w.wo)  # (T, D)

    def generate(
        self, prompt_ids: list[int], max_tokens: int, *, row: int = 0, stop_ids: tuple[int, ...] = ()
    ) -> list[int]:
        """Greedy: prefill into cache row `row`, then one token per pass."""
        logits = self.forward(
            torch.tensor(prompt_ids),
            torch.arange(len(prompt_ids)),
            torch.full((len(prompt_ids),), row),
            torch.tensor([len(prompt_ids) - 1]),
        )[0]  # (V,)
        out: list[int] = []
        for step in range(max_tokens):
            token = int(logits.argmax())
            out.append(token)
            if token in stop_ids or step == max_tokens - 1:
                break
            position = torch.tensor([len(prompt_ids) + step])
            logits = self.forward(torch.tensor([token]), position, torch.tensor([row]))[0]  # (V,)
        return out
