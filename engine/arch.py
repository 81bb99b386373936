"""What differs between the dense architectures the engine runs, written once per architecture.

`engine.gguf_loader` reads a file's `general.architecture`, looks its `Architecture` up here and
loads the tensors it names; `engine.model` computes what the weights and the config hold. The
numbers (layers, sizes, RoPE theta and scaling, epsilon, window, softcaps) come from the file's
metadata; what is fixed per architecture, as llama.cpp builds its graph (src/models/<arch>.cpp),
is here:

- which tensors a block holds beyond attention and the gated feed-forward: per-head q/k norms
  (gemma3, qwen3), q/k/v biases (qwen2), norms after attention and after the feed-forward (gemma3);
- the feed-forward's activation: GELU (tanh form) for gemma3, SiLU (SwiGLU) for the others;
- the RoPE form: NEOX (rotate halves) for gemma3 and qwen, pairwise (llama.cpp's "normal") for
  llama, whose converter permuted q and k to suit it;
- whether token embeddings are scaled by sqrt(d_model) (gemma3) and whether layers use a
  sliding window with its own RoPE base (gemma3) and soft-capped logits (Gemma's keys).

Every architecture's RMSNorm weights are used as stored: llama.cpp's converter already folded
Gemma's `1 + w` into them, so the norm is one formula everywhere. The output head is
`output.weight` when the file has one, else the token embedding (tied), for every architecture.

No torch here: the gateway asks `architecture()` whether a file can be served as a ring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gguf import GGUFReader

from engine.gguf_meta import BLOCK_TENSORS, gguf_tensors

__all__ = ["ARCHITECTURES", "Architecture", "architecture", "layer_bytes"]

Activation = Literal["gelu_tanh", "silu"]

# `engine.model.LayerWeights` field -> tensor name inside blk.N (".weight" for weights, ".bias" for
# biases). The names every block holds in the dense and the MoE layouts are `BLOCK_TENSORS`'.
_QK_NORMS = {field: BLOCK_TENSORS[field] for field in ("q_norm", "k_norm")}
_SHARED = {field: name for field, name in BLOCK_TENSORS.items() if field not in _QK_NORMS}  # attention, ffn_norm
_FEED_FORWARD = {"w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down"}
_POST_NORMS = {"post_attn_norm": "post_attention_norm", "post_ffn_norm": "post_ffw_norm"}
_QKV_BIASES = {"bq": "attn_q", "bk": "attn_k", "bv": "attn_v"}


@dataclass(frozen=True)
class Architecture:
    """One architecture's fixed facts (see the module docstring)."""

    name: str  # general.architecture, as llama.cpp names it
    qk_norm: bool = False  # RMS-norm each head's queries and keys before RoPE
    qkv_bias: bool = False  # q, k and v projections add a bias
    post_norms: bool = False  # RMS-norm attention's and the feed-forward's outputs before the residual add
    activation: Activation = "silu"
    rope_neox: bool = True  # rotate the two halves of a head (NEOX), else adjacent pairs
    embed_scaled: bool = False  # token embeddings times sqrt(d_model)
    sliding_window: bool = False  # local layers (sliding window, own RoPE base) beside global ones
    softcaps: bool = False  # the file's attention and final logit soft-caps apply

    def weight_tensors(self) -> dict[str, str]:
        """Block weights: field -> tensor name inside blk.N (without ".weight")."""
        return {
            **_SHARED,
            **(_QK_NORMS if self.qk_norm else {}),
            **_FEED_FORWARD,
            **(_POST_NORMS if self.post_norms else {}),
        }

    def bias_tensors(self) -> dict[str, str]:
        """Block biases: field -> tensor name inside blk.N (without ".bias")."""
        return dict(_QKV_BIASES) if self.qkv_bias else {}

    def block_tensor_names(self, index: int) -> list[str]:
        """Every tensor of block `index`, as the file names it."""
        weights = [f"blk.{index}.{name}.weight" for name in self.weight_tensors().values()]
        return weights + [f"blk.{index}.{name}.bias" for name in self.bias_tensors().values()]


ARCHITECTURES = {
    arch.name: arch
    for arch in (
        Architecture(
            "gemma3",
            qk_norm=True,
            post_norms=True,
            activation="gelu_tanh",
            embed_scaled=True,
            sliding_window=True,
            softcaps=True,
        ),
        Architecture("llama", rope_neox=False),  # Llama 2/3.x, Mistral
        Architecture("qwen2", qkv_bias=True),  # Qwen 2, Qwen 2.5
        Architecture("qwen3", qk_norm=True),
    )
}


def architecture(name: str) -> Architecture:
    """The description of `name`; an architecture the engine does not run raises ValueError."""
    found = ARCHITECTURES.get(name)
    if found is None:
        raise ValueError(f"unsupported architecture {name!r}: this engine runs {', '.join(sorted(ARCHITECTURES))}")
    return found


HELD_BYTES = {2: 2, 1: 4}  # tensor rank -> bytes per element a stage holds: float16 matrices, float32 norms and biases


def layer_bytes(reader: GGUFReader) -> int:
    """The memory one block takes in a stage (its largest block, dequantized as the engine
    holds it), read from the file's tensor table: what a ring plan splits hosts' memory by."""
    sizes: dict[str, int] = {}
    for name, tensor in gguf_tensors(reader).items():
        block, _, rest = name.partition(".")[2].partition(".")
        if name.startswith("blk.") and rest:
            held = int(tensor.n_elements) * HELD_BYTES.get(len(tensor.shape), 4)
            sizes[block] = sizes.get(block, 0) + held
    if not sizes:
        raise ValueError("the file holds no blocks (no blk.N tensors)")
    return max(sizes.values())
