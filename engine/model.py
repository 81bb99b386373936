"""A dense transformer (Gemma 3, Llama 3.x / Mistral, Qwen 2.5, Qwen 3) as three plain things:
`Config` (the blueprint read from GGUF metadata, with its `engine.arch.Architecture`), weights
per layer (`LayerWeights`, grouped per stage in `StageWeights`) and a `KVCache` allocated up
front and written at `pos`. `Stage` runs any contiguous layer range [start, end).

Shapes use T = tokens in the (packed) batch, D = d_model, H = query heads, KV = key/value
heads, Hd = head_dim, F = ffn dim, V = vocab, R = cache rows, C = cache context length.

Numerics follow llama.cpp on the same GGUF, which is the reference the golden tests hold us
to: norm weights are used as stored (llama.cpp's converter already folded Gemma's `1 + w`
into them). What differs between architectures (q/k norms, biases, post-norms, activation,
RoPE form, embedding scale, sliding window) is written once in `engine.arch`; here a block
computes what its weights hold (a norm or bias the architecture lacks is None) and what
the config says.

Weight matrices (and the embedding table) are kept in float16 (`WEIGHT_DTYPE`): a decode step
reads every weight once, so its speed is the bytes it reads, and half the bytes of float32 is
2.6x the decode speed here. Activations, norms, the residual stream and the KV cache stay
float32. `linear` gives every product the same numerics whatever the batch: inputs and outputs
rounded to float16, sums in float32 (llama.cpp itself rounds activations to 8 bits).

A batch is *packed*: T tokens from any number of requests, each token carrying its own
position and the cache row of its request. One prefill and several decodes share one pass.

The output head may be *shared* in a ring (`output_share`): the head stage holds the first
half of the vocabulary's rows and the tail the second, so both compute a lone request's
logits at once instead of the tail reading the whole (V, D) table while the head waits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from engine.arch import Architecture

if TYPE_CHECKING:
    from engine.moe_gguf import MoeConfig

__all__ = [
    "AttentionWeights",
    "Config",
    "ContextOverflowError",
    "DenseEmbedding",
    "Embedding",
    "KVCache",
    "LayerWeights",
    "RowSpan",
    "Stage",
    "StageWeights",
    "WEIGHT_DTYPE",
    "linear",
    "output_share",
]


WEIGHT_DTYPE = torch.float16
HALF_KERNEL_ROWS = 2  # up to this many rows use the float16 kernel on CPU; more rows upcast the weight
UPCAST_BLOCK = 2048  # weight rows upcast at a time (a cache-sized float32 block: the output head is 262k rows)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T for float32 activations and a weight stored in `WEIGHT_DTYPE` (float32 weights,
    as the MoE keeps them, multiply as they are).

    A few rows (a decode) run the float16 kernel, which reads half the bytes. CPU float16 GEMM
    costs more with every row, though, so more rows (a prefill, packed decodes) upcast the
    weight a block at a time and run the float32 kernel on it while it is in cache. Both
    round inputs and outputs to float16 and sum in float32, so a row's result does not depend
    on what it was packed with (up to the order of the sums)."""
    # x: (T, in) float32; w: (out, in) -> (T, out) float32
    if w.dtype == torch.float32:
        return x @ w.T
    if x.shape[0] <= HALF_KERNEL_ROWS or x.device.type != "cpu":
        return (x.to(w.dtype) @ w.T).float()
    rounded_t = x.to(w.dtype).float().T  # (in, T)
    out_t = torch.empty(w.shape[0], x.shape[0])  # (out, T): each block's result is a contiguous run of rows
    buffer = torch.empty(min(UPCAST_BLOCK, w.shape[0]), w.shape[1])  # (B, in), reused block after block
    for first in range(0, w.shape[0], UPCAST_BLOCK):
        rows = min(UPCAST_BLOCK, w.shape[0] - first)
        block = buffer[:rows]
        block.copy_(w[first : first + rows])
        torch.mm(block, rounded_t, out=out_t[first : first + rows])
    return out_t.T.to(w.dtype).float()


class ContextOverflowError(ValueError):
    """A token's position does not fit in the KV cache allocated for its row."""


@dataclass(frozen=True)
class Config:
    """The model's blueprint, read from GGUF metadata (see `engine.gguf_loader.read_config`)."""

    arch: str
    architecture: Architecture  # what is fixed per architecture (engine.arch)
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    rms_eps: float
    context_length: int
    rope_base_global: float
    rope_base_local: float
    rope_scale_global: float  # positions are multiplied by this on global layers (linear scaling)
    sliding_window: int
    local_layers: tuple[bool, ...]  # local_layers[i]: layer i uses sliding-window attention
    attn_scale: float  # multiplies q·k (1/sqrt(query_pre_attn_scalar))
    embed_scale: float  # multiplies token embeddings (sqrt(d_model) for Gemma)
    final_logit_softcap: float | None = None
    attn_logit_softcap: float | None = None
    rope_freq_factors: tuple[float, ...] | None = None  # (Hd/2,) divide RoPE frequencies (Llama 3.1's rope_freqs)

    def is_local(self, layer: int) -> bool:
        return self.local_layers[layer]

    def rope_base(self, layer: int) -> float:
        return self.rope_base_local if self.is_local(layer) else self.rope_base_global


@dataclass
class AttentionWeights:
    """A block's attention, dequantized (every architecture here and `engine.moe`'s qwen3moe
    share it). Matrices are (out, in); q/k norms and biases are None where the architecture
    has none."""

    index: int
    attn_norm: torch.Tensor  # (D,)
    wq: torch.Tensor  # (H*Hd, D)
    wk: torch.Tensor  # (KV*Hd, D)
    wv: torch.Tensor  # (KV*Hd, D)
    q_norm: torch.Tensor | None  # (Hd,)
    k_norm: torch.Tensor | None  # (Hd,)
    wo: torch.Tensor  # (D, H*Hd)
    bq: torch.Tensor | None = field(default=None, kw_only=True)  # (H*Hd,)
    bk: torch.Tensor | None = field(default=None, kw_only=True)  # (KV*Hd,)
    bv: torch.Tensor | None = field(default=None, kw_only=True)  # (KV*Hd,)


@dataclass
class LayerWeights(AttentionWeights):
    """One transformer block: its attention, then the gated feed-forward (and Gemma's post-norms)."""

    ffn_norm: torch.Tensor  # (D,)
    w_gate: torch.Tensor  # (F, D)
    w_up: torch.Tensor  # (F, D)
    w_down: torch.Tensor  # (D, F)
    post_attn_norm: torch.Tensor | None = field(default=None, kw_only=True)  # (D,)
    post_ffn_norm: torch.Tensor | None = field(default=None, kw_only=True)  # (D,)


class Embedding(Protocol):
    """Token id -> embedding row lookup (dense, or dequantized on demand)."""

    def rows(self, token_ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, D)
        ...


@dataclass
class DenseEmbedding:
    table: torch.Tensor  # (V, D)

    def rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.table[token_ids].float()  # (T, D)


def tensors_to_device(holder: object, device: torch.device) -> None:
    """Move the tensors among `holder`'s attributes (a layer's weights) to `device`, in place."""
    for name, value in vars(holder).items():
        if isinstance(value, torch.Tensor):
            setattr(holder, name, value.to(device))


@dataclass
class StageWeights:
    """The tensors of layers [start, end): embeddings only at the head (start == 0),
    final norm and output head only at the tail (end == n_layers)."""

    start: int
    end: int
    layers: list[LayerWeights]
    embedding: Embedding | None = None  # head only
    output_norm: torch.Tensor | None = None  # (D,) tail only, or at a head that shares the output head
    output: torch.Tensor | None = None  # (V_s, D): the output head's rows [vocab_lo, vocab_lo + V_s)
    vocab_lo: int = 0  # first vocabulary row of `output` (0 unless the output head is shared)
    names: frozenset[str] = field(default_factory=frozenset)  # GGUF tensors this stage read

    def to_device(self, device: torch.device) -> None:
        """Move every tensor to `device` (a quantised embedding table stays in host memory:
        its rows are dequantised there and sent over)."""
        for layer in self.layers:
            tensors_to_device(layer, device)
        if isinstance(self.embedding, DenseEmbedding):
            self.embedding.table = self.embedding.table.to(device)
        if self.output_norm is not None:
            self.output_norm = self.output_norm.to(device)
        if self.output is not None:
            self.output = self.output.to(device)


def output_share(vocab_size: int, start: int, end: int, n_layers: int) -> tuple[int, int] | None:
    """The vocabulary rows [lo, hi) of the output head a ring stage over [start, end) holds
    when the ring shares it: the head the first half, the tail the second, others none.
    (A stage that is both head and tail is not a ring; it holds the whole head: None.)"""
    is_head, is_tail = start == 0, end == n_layers
    if is_head == is_tail:
        return None
    half = vocab_size // 2
    return (0, half) if is_head else (half, vocab_size)


@dataclass(frozen=True)
class RowSpan:
    """One request's share of a packed pass: `n_tokens` tokens at positions
    [start, start + n_tokens). A decode is one token; a prefill is the prompt (or a chunk)."""

    request_id: str
    start: int
    n_tokens: int


class KVCache:
    """Keys and values of one stage's layers for `n_rows` requests, allocated up front.

    A request owns one row (`assign(request_id)`); a token at position `pos` writes its
    key/value at column `pos` of its row. Positions must lie in [0, n_ctx). A released row
    needs no clearing: attention reads only columns up to the query's position, which the
    row's new owner has written itself.
    """

    def __init__(
        self,
        config: Config | MoeConfig,
        n_layers: int,
        n_rows: int,
        n_ctx: int,
        *,
        device: torch.device | None = None,
    ) -> None:
        if n_ctx > config.context_length:
            raise ValueError(f"n_ctx {n_ctx} exceeds the model's context length {config.context_length}")
        shape = (n_layers, n_rows, n_ctx, config.n_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, device=device)  # (L, R, C, KV, Hd)
        self.v = torch.zeros(shape, device=device)  # (L, R, C, KV, Hd)
        self.n_rows = n_rows
        self.n_ctx = n_ctx
        self._row_of: dict[str, int] = {}

    def assign(self, request_id: str) -> int:
        """Give `request_id` a free row (idempotent: a known request keeps its row)."""
        if request_id in self._row_of:
            return self._row_of[request_id]
        free = sorted(set(range(self.n_rows)) - set(self._row_of.values()))
        if not free:
            raise RuntimeError(f"all {self.n_rows} KV cache rows are taken")
        self._row_of[request_id] = free[0]
        return free[0]

    def release(self, request_id: str) -> None:
        self._row_of.pop(request_id, None)

    def row_of(self, request_id: str) -> int:
        return self._row_of[request_id]

    def check(self, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """Raise before any write if a token would fall outside the cache."""
        if positions.shape != rows.shape or positions.ndim != 1:
            raise ValueError("positions and cache rows must be two (T,) tensors")
        if positions.numel() == 0:
            return
        if int(positions.max()) >= self.n_ctx:
            worst = int(positions.argmax())
            raise ContextOverflowError(
                f"context overflow: position {int(positions[worst])} of cache row {int(rows[worst])} "
                f"is past the context window of {self.n_ctx} tokens"
            )
        if int(positions.min()) < 0:
            raise ValueError("positions must be non-negative")
        if int(rows.min()) < 0 or int(rows.max()) >= self.n_rows:
            raise ValueError(f"cache rows must lie in [0, {self.n_rows})")

    def write(self, layer: int, rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # rows, positions: (T,); k, v: (T, KV, Hd)
        self.k[layer, rows, positions] = k
        self.v[layer, rows, positions] = v


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: (..., N); weight: (N,) -> (..., N). Weight used as stored (see module docstring).
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    base: float,
    scale: float,
    *,
    neox: bool = True,
    freq_factors: Sequence[float] | None = None,
) -> torch.Tensor:
    """Rotary embedding by position * scale * base^(-2i/Hd) / freq_factors[i]: NEOX rotates
    the two halves of each head against each other, the pairwise form adjacent elements."""
    # x: (T, heads, Hd); positions: (T,)
    half = x.shape[-1] // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float64, device=x.device) * 2 / x.shape[-1])  # (Hd/2,)
    if freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float64, device=x.device)
    angles = (positions.to(torch.float64) * scale)[:, None] * inv_freq[None, :]  # (T, Hd/2)
    cos = angles.cos().to(x.dtype)[:, None, :]  # (T, 1, Hd/2)
    sin = angles.sin().to(x.dtype)[:, None, :]  # (T, 1, Hd/2)
    if neox:
        x1, x2 = x[..., :half], x[..., half:]  # (T, heads, Hd/2) each
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)  # (T, heads, Hd)
    pairs = x.unflatten(-1, (half, 2))  # (T, heads, Hd/2, 2)
    x1, x2 = pairs[..., 0], pairs[..., 1]  # (T, heads, Hd/2) each
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)  # (T, heads, Hd)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {  # engine.arch.Activation -> function
    "gelu_tanh": gelu_tanh,
    "silu": torch.nn.functional.silu,
}


class HeadShape(Protocol):
    """The config fields attention needs (`Config` and `engine.moe_gguf.MoeConfig` both have them)."""

    @property
    def n_heads(self) -> int: ...
    @property
    def n_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def rms_eps(self) -> float: ...


def qkv(
    w: AttentionWeights,
    x: torch.Tensor,
    positions: torch.Tensor,
    c: HeadShape,
    *,
    rope_base: float,
    rope_scale: float,
    neox: bool = True,
    freq_factors: Sequence[float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Project the normed hidden state x (T, D) (adding the biases the block has), RMS-norm q
    and k per head where the block has those norms, then rotate them (see `rope`)."""
    t = x.shape[0]
    q = _project(x, w.wq, w.bq).view(t, c.n_heads, c.head_dim)  # (T, H, Hd)
    k = _project(x, w.wk, w.bk).view(t, c.n_kv_heads, c.head_dim)  # (T, KV, Hd)
    v = _project(x, w.wv, w.bv).view(t, c.n_kv_heads, c.head_dim)  # (T, KV, Hd)
    if w.q_norm is not None and w.k_norm is not None:
        q = rms_norm(q, w.q_norm, c.rms_eps)
        k = rms_norm(k, w.k_norm, c.rms_eps)
    q = rope(q, positions, rope_base, rope_scale, neox=neox, freq_factors=freq_factors)  # (T, H, Hd)
    k = rope(k, positions, rope_base, rope_scale, neox=neox, freq_factors=freq_factors)  # (T, KV, Hd)
    return q, k, v


def _project(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # x: (T, in); w: (out, in); bias: (out,) -> (T, out)
    out = linear(x, w)
    return out if bias is None else out + bias


def cached_attention(
    cache: KVCache,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor,
    *,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Write k, v at (layer, row, position) of `cache`, then causal GQA attention per request
    (also limited to the last `window` positions when given)."""
    # q: (T, H, Hd); k, v: (T, KV, Hd); positions, rows: (T,) -> (T, H, Hd)
    cache.write(layer, rows, positions, k, v)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # (T, H, Hd)
    for row in rows.unique().tolist():
        mine = (rows == row).nonzero().squeeze(1)  # (Tr,) token indices of this request
        q_pos = positions[mine]  # (Tr,)
        length = int(q_pos.max()) + 1
        keys = cache.k[layer, row, :length]  # (S, KV, Hd)
        values = cache.v[layer, row, :length]  # (S, KV, Hd)
        out[mine] = _attend(q[mine], keys, values, q_pos, scale=scale, softcap=softcap, window=window)
    return out


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    q_pos: torch.Tensor,
    *,
    scale: float,
    softcap: float | None,
    window: int | None,
) -> torch.Tensor:
    """Causal (and, given a window, sliding-window) GQA attention for one request."""
    # q: (Tr, H, Hd); keys, values: (S, KV, Hd); q_pos: (Tr,) -> (Tr, H, Hd)
    tr, n_heads, head_dim = q.shape
    s, n_kv_heads = keys.shape[0], keys.shape[1]
    qg = q.view(tr, n_kv_heads, n_heads // n_kv_heads, head_dim)  # (Tr, KV, G, Hd)
    scores = torch.einsum("tkgd,skd->kgts", qg, keys) * scale  # (KV, G, Tr, S)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    k_pos = torch.arange(s, device=keys.device)  # (S,)
    visible = k_pos[None, :] <= q_pos[:, None]  # (Tr, S)
    if window is not None:
        visible &= (q_pos[:, None] - k_pos[None, :]) < window
    scores = scores.masked_fill(~visible, float("-inf"))  # (KV, G, Tr, S)
    probs = torch.softmax(scores, dim=-1)  # (KV, G, Tr, S)
    out = torch.einsum("kgts,skd->tkgd", probs, values)  # (Tr, KV, G, Hd)
    return out.reshape(tr, n_heads, head_dim)  # (Tr, H, Hd)


class Stage:
    """Layers [start, end) of the model with their own KV cache.

    `forward(x, positions, cache_rows)`: at the head `x` is token ids (T,), elsewhere the
    hidden state (T, D) handed over by the previous stage. Returns the hidden state (T, D),
    or at the tail the logits (T', V_s) of its vocabulary rows for the tokens selected by
    `logits_for` (all if None).
    """

    def __init__(
        self,
        config: Config,
        weights: StageWeights,
        start: int,
        end: int,
        *,
        n_rows: int = 4,
        n_ctx: int = 1024,
        device: torch.device | str = "cpu",
    ) -> None:
        """`device`: where the weights and the cache live (see `engine.device`); inputs are
        taken from, and results handed back on, the CPU."""
        if not 0 <= start < end <= config.n_layers:
            raise ValueError(f"bad layer range [{start}, {end}) for {config.n_layers} layers")
        if (weights.start, weights.end) != (start, end):
            raise ValueError(f"weights hold layers [{weights.start}, {weights.end}), stage wants [{start}, {end})")
        self.config = config
        self.weights = weights
        self.start = start
        self.end = end
        self.is_head = start == 0
        self.is_tail = end == config.n_layers
        if self.is_head != (weights.embedding is not None):
            raise ValueError("token embeddings belong to the head stage, and only to it")
        has_output = weights.output is not None and weights.output_norm is not None
        if self.is_tail and not has_output:
            raise ValueError("the tail stage needs the output norm and output head")
        if (
            not self.is_tail
            and weights.output is not None
            and (not self.is_head or weights.output.shape[0] >= config.vocab_size)
        ):
            raise ValueError("the output head belongs to the tail stage; the head may hold only a share of it")
        self.shares_output = has_output and weights.output.shape[0] < config.vocab_size  # type: ignore[union-attr]
        self.device = torch.device(device)
        if self.device.type != "cpu":
            weights.to_device(self.device)
        self.cache = KVCache(config, end - start, n_rows, n_ctx, device=self.device)
        self._activation = ACTIVATIONS[config.architecture.activation]

    @property
    def vocab_slice(self) -> tuple[int, int] | None:
        """The vocabulary rows [lo, hi) whose logits this stage computes, if any."""
        output = self.weights.output
        return None if output is None else (self.weights.vocab_lo, self.weights.vocab_lo + output.shape[0])

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        # h: (R, D) -> (R, D)
        assert self.weights.output_norm is not None, "only a stage holding the output head normalises for it"
        return rms_norm(h, self.weights.output_norm, self.config.rms_eps)

    @torch.inference_mode()
    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Logits of this stage's vocabulary rows for final-normed hidden states (soft-capped)."""
        # normed: (R, D) -> (R, V_s)
        assert self.weights.output is not None, "this stage holds no output head"
        logits = linear(normed.to(self.device), self.weights.output)  # (R, V_s)
        cap = self.config.final_logit_softcap
        return self._host(logits if cap is None else torch.tanh(logits / cap) * cap)

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        """A result, on the CPU (where the wire and the callers take it)."""
        return t if self.device.type == "cpu" else t.cpu()

    def forward_rows(self, x: torch.Tensor, membership: Sequence[RowSpan], *, normed: bool = False) -> torch.Tensor:
        """Run one packed pass described by its batch membership, as the ring forwards it.

        `x` holds the rows' tokens (head) or hidden states in membership order. Each request
        keeps its own cache row in this stage. The tail returns one logits row per member:
        the logits after that member's last token (of its vocabulary slice); with `normed`,
        the final-normed hidden state instead, for a ring that shares the output head.
        """
        # x: (T,) or (T, D) with T = sum of n_tokens
        positions = torch.cat([torch.arange(span.start, span.start + span.n_tokens) for span in membership])  # (T,)
        rows = torch.cat(
            [torch.full((span.n_tokens,), self.cache.assign(span.request_id)) for span in membership]
        )  # (T,)
        if not self.is_tail:
            return self.forward(x, positions, rows)  # (T, D)
        last = torch.tensor([span.n_tokens for span in membership]).cumsum(0) - 1  # (R,)
        return self.forward(x, positions, rows, logits_for=last, normed_only=normed)  # (R, V_s) or (R, D)

    @torch.inference_mode()
    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache_rows: torch.Tensor,
        logits_for: torch.Tensor | None = None,
        capture: dict[int, torch.Tensor] | None = None,
        normed_only: bool = False,
    ) -> torch.Tensor:
        """`capture`, if given, receives {layer index: hidden state (T, D) after that layer}
        so that tools and tests can compare boundaries between differently split pipelines.
        At the tail, `normed_only` stops after the final norm (the rows `logits_for` selects)."""
        # x: (T,) int64 token ids at the head, else (T, D) float32; positions, cache_rows: (T,) int64
        if logits_for is not None and not self.is_tail:
            raise ValueError("logits_for only applies to the tail stage")
        self.cache.check(positions, cache_rows)
        if self.device.type != "cpu":
            x, positions, cache_rows = x.to(self.device), positions.to(self.device), cache_rows.to(self.device)
            logits_for = None if logits_for is None else logits_for.to(self.device)
        embedding = self.weights.embedding  # present exactly at the head (checked in __init__)
        h = x if embedding is None else embedding.rows(x).to(self.device) * self.config.embed_scale  # (T, D)
        for local_index, layer in enumerate(self.weights.layers):
            h = self._block(layer, local_index, h, positions, cache_rows)  # (T, D)
            if capture is not None:
                capture[layer.index] = self._host(h)
        if not self.is_tail:
            return self._host(h)
        if logits_for is not None:
            h = h[logits_for]  # (T', D)
        normed = self.final_norm(h)  # (T', D)
        return self._host(normed) if normed_only else self.logits(normed)  # (T', D) or (T', V_s)

    __call__ = forward

    def _block(
        self, w: LayerWeights, local_index: int, h: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        eps = self.config.rms_eps
        a = self._attention(w, local_index, rms_norm(h, w.attn_norm, eps), positions, rows)  # (T, D)
        h = h + (a if w.post_attn_norm is None else rms_norm(a, w.post_attn_norm, eps))  # (T, D)
        x = rms_norm(h, w.ffn_norm, eps)  # (T, D)
        f = linear(self._activation(linear(x, w.w_gate)) * linear(x, w.w_up), w.w_down)  # (T, F) -> (T, D)
        return h + (f if w.post_ffn_norm is None else rms_norm(f, w.post_ffn_norm, eps))  # (T, D)

    def _attention(
        self, w: LayerWeights, local_index: int, x: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        c = self.config
        local = c.is_local(w.index)
        scale = 1.0 if local else c.rope_scale_global
        q, k, v = qkv(
            w,
            x,
            positions,
            c,
            rope_base=c.rope_base(w.index),
            rope_scale=scale,
            neox=c.architecture.rope_neox,
            freq_factors=c.rope_freq_factors,
        )
        out = cached_attention(
            self.cache,
            local_index,
            q,
            k,
            v,
            positions,
            rows,
            scale=c.attn_scale,
            softcap=c.attn_logit_softcap,
            window=c.sliding_window if local else None,
        )  # (T, H, Hd)
        return linear(out.view(x.shape[0], c.n_heads * c.head_dim), w.wo)  # (T, D)
