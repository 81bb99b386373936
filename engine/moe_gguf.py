"""MoE GGUF files in llama.cpp's `qwen3moe` layout (and Mixtral's, `llama` with experts: the
same without q/k norms, see `MOE_ARCHES`), with `gguf` and numpy only: the blueprint
(`MoeConfig`), the byte vocabulary, expert slice files and the tiny test model.

Per layer N the file holds attention (`blk.N.attn_{norm,q,k,v,output,q_norm,k_norm}`), the
feed-forward norm `blk.N.ffn_norm`, the router `blk.N.ffn_gate_inp` (E, D) and the experts
stacked in three 3-D tensors: `blk.N.ffn_gate_exps` and `blk.N.ffn_up_exps` (E, F, D) and
`blk.N.ffn_down_exps` (E, D, F) (numpy order; ggml's `ne` is reversed). Metadata:
`{arch}.expert_count`, `{arch}.expert_used_count`, `{arch}.expert_feed_forward_length` and,
where the architecture has one, `{arch}.expert_gating_func`.

A *slice file* (`write_expert_slice`) holds only experts [first, first + count) of one layer
and records its place with `elephant.expert_slice.{layer,first}`; it is what the gateway
serves to a volunteer, and `engine.moe_loader.load_expert_slice` reads it into torch.

`make_tiny_moe` writes a small model with that real layout and seeded random weights,
with a byte-level vocabulary (ids 0..255 are bytes, then BOS and EOS).

Nothing here imports torch: the gateway reads expert counts and cuts slices through this
module without paying for torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, TokenType

from engine.gguf_meta import BLOCK_TENSORS, _PlainArrayReader, gguf_field, gguf_required, gguf_tensors

__all__ = [
    "BYTE_BOS",
    "BYTE_EOS",
    "ByteTokenizer",
    "Gating",
    "MoeConfig",
    "SLICE_FIRST_KEY",
    "SLICE_LAYER_KEY",
    "expert_tensor_names",
    "has_byte_vocabulary",
    "make_tiny_moe",
    "read_moe_config",
    "write_expert_slice",
]

# What is fixed per MoE architecture, as llama.cpp builds its graph (src/models/<arch>.cpp):
# whether heads' queries and keys are RMS-normed, and the RoPE form (NEOX halves, or llama's
# adjacent pairs). Both route with softmax over every expert, keep the top K and renormalise.
MOE_ARCHES = {
    "qwen3moe": {"qk_norm": True, "rope_neox": True},  # Qwen 3 MoE (Qwen3-30B-A3B, 235B-A22B)
    "llama": {"qk_norm": False, "rope_neox": False},  # Mixtral: llama blocks with routed experts
}
SLICE_LAYER_KEY = "elephant.expert_slice.layer"
SLICE_FIRST_KEY = "elephant.expert_slice.first"
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
LAYER_TENSORS = {**BLOCK_TENSORS, "router": "ffn_gate_inp"}  # MoeLayerWeights field -> name inside blk.N.
QK_NORMS = ("q_norm", "k_norm")
BYTE_BOS, BYTE_EOS = 256, 257


class Gating(enum.IntEnum):
    """llama.cpp's `expert_gating_func` values."""

    SOFTMAX = 1
    SIGMOID = 2


@dataclass(frozen=True)
class MoeConfig:
    """The MoE model's blueprint (see `read_moe_config`)."""

    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_eps: float
    context_length: int
    rope_base: float
    n_experts: int  # E
    n_experts_used: int  # K
    expert_ffn_dim: int  # F
    gating: Gating = Gating.SOFTMAX
    norm_topk: bool = True  # renormalise the K kept weights to sum to one (qwen3moe and Mixtral do)
    rope_scale: float = 1.0  # positions are multiplied by this (linear RoPE scaling: 1 / factor)
    qk_norm: bool = True  # see MOE_ARCHES
    rope_neox: bool = True

    @property
    def attn_scale(self) -> float:
        return self.head_dim**-0.5

    def layer_tensors(self) -> dict[str, str]:
        """A block's tensors but its experts: `MoeLayerWeights` field -> name inside blk.N."""
        return {f: n for f, n in LAYER_TENSORS.items() if self.qk_norm or f not in QK_NORMS}


def read_moe_config(reader: GGUFReader) -> MoeConfig:
    """The blueprint from the file's metadata; an architecture other than `MOE_ARCHES`, or a
    file lacking a required key, raises ValueError."""
    arch = gguf_required(reader, "general.architecture")
    if arch not in MOE_ARCHES:
        raise ValueError(f"unsupported MoE architecture {arch!r}: this engine runs {', '.join(MOE_ARCHES)}")
    d_model = int(gguf_required(reader, f"{arch}.embedding_length"))
    n_heads = int(gguf_required(reader, f"{arch}.attention.head_count"))
    head_dim = int(gguf_field(reader, f"{arch}.attention.key_length", d_model // n_heads))
    if int(gguf_field(reader, f"{arch}.attention.value_length", head_dim)) != head_dim:
        raise ValueError("keys and values of different head sizes are not supported")
    if int(gguf_field(reader, f"{arch}.rope.dimension_count", head_dim)) != head_dim:
        raise ValueError("RoPE over part of a head is not supported")
    embd = gguf_tensors(reader).get("token_embd.weight")
    vocab = int(embd.shape[1]) if embd is not None else int(gguf_field(reader, f"{arch}.vocab_size", 0))
    return MoeConfig(
        arch=arch,
        n_layers=int(gguf_required(reader, f"{arch}.block_count")),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=int(gguf_field(reader, f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        vocab_size=vocab,
        rms_eps=float(gguf_required(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        context_length=int(gguf_required(reader, f"{arch}.context_length")),
        rope_base=float(gguf_field(reader, f"{arch}.rope.freq_base", 10_000.0)),
        n_experts=int(gguf_required(reader, f"{arch}.expert_count")),
        n_experts_used=int(gguf_required(reader, f"{arch}.expert_used_count")),
        expert_ffn_dim=int(
            gguf_field(reader, f"{arch}.expert_feed_forward_length")  # Mixtral's: the dense key
            or gguf_required(reader, f"{arch}.feed_forward_length")
        ),
        gating=Gating(int(gguf_field(reader, f"{arch}.expert_gating_func", Gating.SOFTMAX))),
        rope_scale=_rope_scale(reader, arch),
        **MOE_ARCHES[arch],
    )


def _rope_scale(reader: GGUFReader, arch: str) -> float:
    """What positions are multiplied by: 1 / factor for linear scaling, 1 for none; a scaling
    the engine does not compute (YaRN, which a Qwen 3 MoE file may carry for long contexts)
    raises ValueError rather than computing other logits than llama.cpp's."""
    kind = gguf_field(reader, f"{arch}.rope.scaling.type", "none")
    if kind not in ("none", "linear"):
        raise ValueError(f"RoPE scaling {kind!r} is not supported (only none, linear)")
    factor = float(gguf_field(reader, f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    return 1.0 / factor if kind == "linear" else 1.0


def expert_tensor_names(layer: int) -> list[str]:
    """The stacked expert tensors of `layer`: gate, up, down."""
    return [f"blk.{layer}.{name}.weight" for name in EXPERT_TENSORS]


def _copy_metadata(reader: GGUFReader, writer: GGUFWriter, arch: str) -> None:
    """The architecture's keys (what `read_moe_config` needs), never tokenizer tables."""
    for key, found in reader.fields.items():
        if not key.startswith(f"{arch}."):
            continue
        value = found.contents()
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)


def write_expert_slice(path: str | Path, layer: int, first: int, count: int, dest: str | Path) -> list[str]:
    """Write a GGUF holding only experts [first, first + count) of `layer` (in their stored
    encoding) plus the architecture metadata; returns the tensor names written. The file is
    parsed afresh (not through `open_gguf`'s cache): a one-off cut must see the file as it is now
    (with `open_gguf`'s faster reader: a real vocabulary, Qwen 3's 151,936 tokens, takes 16 s to
    parse with gguf's own, 5.5 s with it)."""
    reader = _PlainArrayReader(str(path))
    config = read_moe_config(reader)
    load_check = 0 <= layer < config.n_layers and 0 <= first and count > 0 and first + count <= config.n_experts
    if not load_check:
        raise ValueError(f"no slice layer {layer} experts [{first}, {first + count})")
    tensors = gguf_tensors(reader)
    writer = GGUFWriter(str(dest), config.arch)
    _copy_metadata(reader, writer, config.arch)
    writer.add_uint32(SLICE_LAYER_KEY, layer)
    writer.add_uint32(SLICE_FIRST_KEY, first)
    names = expert_tensor_names(layer)
    for name in names:
        tensor = tensors[name]
        rows = np.ascontiguousarray(tensor.data[first : first + count])  # (count, rows, cols or bytes per row)
        quantized = tensor.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
        writer.add_tensor(name, rows, raw_dtype=tensor.tensor_type if quantized else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return names


def make_tiny_moe(
    path: str | Path,
    *,
    seed: int = 0,
    n_layers: int = 2,
    d_model: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    head_dim: int = 16,
    n_experts: int = 8,
    n_experts_used: int = 2,
    expert_ffn_dim: int = 32,
    context_length: int = 256,
) -> Path:
    """A small qwen3moe GGUF with seeded random float32 weights and a 258-id byte vocabulary
    (llama.cpp loads it; the golden test compares its logits with ours)."""
    arch, vocab = "qwen3moe", 258
    rng = np.random.default_rng(seed)

    def rand(*shape: int, scale: float = 0.1) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + rng.standard_normal(n) * 0.05).astype(np.float32)

    writer = GGUFWriter(str(path), arch)
    writer.add_name("tiny-moe")
    writer.add_block_count(n_layers)
    writer.add_context_length(context_length)
    writer.add_embedding_length(d_model)
    writer.add_feed_forward_length(expert_ffn_dim)
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(10_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_expert_count(n_experts)
    writer.add_expert_used_count(n_experts_used)
    writer.add_expert_feed_forward_length(expert_ffn_dim)
    _add_byte_vocabulary(writer)
    writer.add_tensor("token_embd.weight", rand(vocab, d_model, scale=1.0))
    writer.add_tensor("output_norm.weight", norm(d_model))
    writer.add_tensor("output.weight", rand(vocab, d_model))
    for i in range(n_layers):
        layer = {  # by LAYER_TENSORS field, drawn in this order (the seeded weights depend on it)
            "attn_norm": norm(d_model),
            "wq": rand(n_heads * head_dim, d_model),
            "wk": rand(n_kv_heads * head_dim, d_model),
            "wv": rand(n_kv_heads * head_dim, d_model),
            "q_norm": norm(head_dim),
            "k_norm": norm(head_dim),
            "wo": rand(d_model, n_heads * head_dim),
            "ffn_norm": norm(d_model),
            "router": rand(n_experts, d_model, scale=0.5),
        }
        for field, name in LAYER_TENSORS.items():
            writer.add_tensor(f"blk.{i}.{name}.weight", layer[field])
        gate = rand(n_experts, expert_ffn_dim, d_model, scale=0.3)  # (E, F, D)
        up = rand(n_experts, expert_ffn_dim, d_model, scale=0.3)  # (E, F, D)
        down = rand(n_experts, d_model, expert_ffn_dim, scale=0.3)  # (E, D, F)
        for name, stacked in zip(expert_tensor_names(i), (gate, up, down), strict=True):
            writer.add_tensor(name, stacked)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def _add_byte_vocabulary(writer: GGUFWriter) -> None:
    """A SentencePiece-style table of byte tokens, so llama.cpp loads the tiny model too."""
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"<0x{b:02X}>" for b in range(256)] + ["<s>", "</s>"])
    writer.add_token_scores([0.0] * 258)
    writer.add_token_types([TokenType.BYTE] * 256 + [TokenType.CONTROL] * 2)
    writer.add_bos_token_id(BYTE_BOS)
    writer.add_eos_token_id(BYTE_EOS)


def has_byte_vocabulary(reader: GGUFReader) -> bool:
    """Whether the file's vocabulary is `ByteTokenizer`'s: ids 0..255 the bytes, then BOS
    and EOS (what `make_tiny_moe` writes); a real MoE GGUF has a BPE vocabulary instead."""
    tokens = gguf_field(reader, "tokenizer.ggml.tokens") or []
    return (
        len(tokens) == BYTE_EOS + 1
        and tokens[:256] == [f"<0x{b:02X}>" for b in range(256)]
        and gguf_field(reader, "tokenizer.ggml.bos_token_id") == BYTE_BOS
        and gguf_field(reader, "tokenizer.ggml.eos_token_id") == BYTE_EOS
    )


class ByteTokenizer:
    """The tiny model's vocabulary: UTF-8 bytes are ids 0..255, then BOS (256) and EOS (257)."""

    bos_id, eos_id = BYTE_BOS, BYTE_EOS

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        return ([BYTE_BOS] if add_bos else []) + list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")
