"""Load an MoE GGUF (`engine.moe_gguf`'s `qwen3moe` layout) into torch weights.

Matrices are kept in float16 (`engine.model.WEIGHT_DTYPE`, as the dense engine keeps them: a
Qwen 3 30B-A3B coordinator holds 61 GB, not 122), norms and the router in float32.

An expert worker reads only experts [first, first + count) of one layer
(`load_expert_slice`): from the whole model file, or from a slice file
(`engine.moe_gguf.write_expert_slice`). `load_moe` reads the whole model, or everything but
the experts when they live elsewhere.

The file format itself (blueprint, byte vocabulary, slice files, the tiny model) lives in
`engine.moe_gguf`, which never imports torch; its names are re-exported here for callers
that load weights anyway.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from gguf import ReaderTensor

from engine.gguf_loader import dequantize_rows
from engine.gguf_meta import gguf_field, gguf_required, gguf_tensors, open_gguf
from engine.model import WEIGHT_DTYPE
from engine.moe import ExpertBank, MoeLayerWeights, MoeWeights
from engine.moe_gguf import (
    BYTE_BOS,
    BYTE_EOS,
    SLICE_FIRST_KEY,
    SLICE_LAYER_KEY,
    ByteTokenizer,
    MoeConfig,
    expert_tensor_names,
    has_byte_vocabulary,
    make_tiny_moe,
    read_moe_config,
    write_expert_slice,
)

__all__ = [
    "BYTE_BOS",
    "BYTE_EOS",
    "ByteTokenizer",
    "expert_tensor_names",
    "has_byte_vocabulary",
    "load_expert_slice",
    "load_moe",
    "make_tiny_moe",
    "read_moe_config",
    "write_expert_slice",
]


def _dense(tensor: ReaderTensor) -> torch.Tensor:
    """Any stored encoding -> a private tensor in numpy order (rows = out): matrices in
    `WEIGHT_DTYPE` as the dense engine keeps them, norms in float32."""
    found = dequantize_rows(tensor.data, tensor.tensor_type)
    return found.to(WEIGHT_DTYPE) if found.ndim >= 2 else found


def _bank(tensors: dict[str, ReaderTensor], layer: int, start: int, count: int, first: int) -> ExpertBank:
    """Experts [first, first + count) of `layer`, read from rows [start, start + count) of the
    stacked tensors (start differs from first in a slice file)."""
    picked = []
    for name in expert_tensor_names(layer):
        tensor = tensors[name]
        if start < 0 or start + count > tensor.data.shape[0]:
            raise ValueError(f"{name} has no experts [{start}, {start + count})")
        picked.append(
            dequantize_rows(tensor.data[start : start + count], tensor.tensor_type).to(WEIGHT_DTYPE)
        )  # only these
    gate, up, down = picked  # (n, F, D), (n, F, D), (n, D, F)
    return ExpertBank(layer, first, gate, up, down)


def load_expert_slice(path: str | Path, layer: int, first: int, count: int) -> tuple[MoeConfig, ExpertBank]:
    """Only experts [first, first + count) of one layer, from a model file or a slice file."""
    reader = open_gguf(path)
    config = read_moe_config(reader)
    if not 0 <= layer < config.n_layers or not (0 <= first and count > 0 and first + count <= config.n_experts):
        raise ValueError(
            f"no slice layer {layer} experts [{first}, {first + count}) in a model of "
            f"{config.n_layers} layers x {config.n_experts} experts"
        )
    slice_layer = gguf_field(reader, SLICE_LAYER_KEY)
    offset = 0
    if slice_layer is not None:
        offset = int(gguf_required(reader, SLICE_FIRST_KEY))
        if int(slice_layer) != layer:
            raise ValueError(f"this slice file holds layer {slice_layer}, not {layer}")
    return config, _bank(gguf_tensors(reader), layer, first - offset, count, first)


def load_moe(path: str | Path, *, with_experts: bool = True) -> tuple[MoeConfig, MoeWeights]:
    """The whole model; `with_experts=False` skips the expert tensors (they live elsewhere)."""
    reader = open_gguf(path)
    config = read_moe_config(reader)
    tensors = gguf_tensors(reader)
    layers = []
    names = {"token_embd.weight", "output_norm.weight"}
    for i in range(config.n_layers):
        wanted = config.layer_tensors()
        loaded: dict[str, Any] = {  # MoeLayerWeights' fields, by name
            "q_norm": None,
            "k_norm": None,
            **{f: _dense(tensors[f"blk.{i}.{n}.weight"]) for f, n in wanted.items()},
        }
        loaded["router"] = loaded["router"].float()  # routing decides which experts run: scored in float32
        names.update(f"blk.{i}.{n}.weight" for n in wanted.values())
        bank = _bank(tensors, i, 0, config.n_experts, 0) if with_experts else None
        if with_experts:
            names.update(expert_tensor_names(i))
        layers.append(MoeLayerWeights(index=i, experts=bank, **loaded))
    embedding = _dense(tensors["token_embd.weight"])  # (V, D)
    output = _dense(tensors["output.weight"]) if "output.weight" in tensors else embedding  # (V, D)
    names.add("output.weight" if "output.weight" in tensors else "token_embd.weight")
    weights = MoeWeights(layers, embedding, _dense(tensors["output_norm.weight"]), output, frozenset(names))
    return config, weights
