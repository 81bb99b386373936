"""What the catalog reads from a model's own GGUF file, and its vocabulary-only copy.

The facts (architecture, context length, chat template, special token ids, sizes,
quantisation) come from the file's metadata through `engine.gguf_meta` (the `gguf` package,
no torch). The copy the gateway counts tokens with is the file's header and metadata,
byte for byte, declaring no tensors, less the BPE merges llama.cpp can never apply
(`catalog.bpe_merges`): llama.cpp loads it with `vocab_only=True` exactly as it loads the
whole file, tokenizes every text as the whole file does, and it weighs what the vocabulary
weighs (a few MB), not the weights.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGUF_DEFAULT_ALIGNMENT, LlamaFileType, ReaderField, TokenType

from catalog.bpe_merges import merges_applicable
from engine.gguf_meta import _PlainArrayReader, gguf_field

GGUF_MAGIC = b"GGUF"
_HEADER_BYTES = 24  # magic (4), version (4), tensor count (8), metadata count (8): GGUF v2 and v3
_TENSOR_COUNT = slice(8, 16)
_MERGES = "tokenizer.ggml.merges"


class GgufUnreadable(ValueError):
    """The file is not a GGUF model this catalog can describe; the message says why."""


@dataclass(frozen=True)
class Merges:
    """A BPE vocabulary's `tokenizer.ggml.merges` entry, where the file holds it."""

    count_at: int  # where the item count starts (the key and types before it stay as they are)
    end: int  # where the entry ends
    u64: str  # the count's and each item length's numpy type, in the file's byte order ("<u8")
    items: tuple[bytes, ...]  # each merge, "left right", in rank order


@dataclass(frozen=True)
class GgufFacts:
    """A GGUF model's blueprint as the catalog stores it."""

    architecture: str
    context_length: int
    chat_template: str  # "" when the file has none
    bos_token_id: int | None
    eos_token_id: int | None
    eot_token_id: int | None
    bos_text: str  # "" when the file names no BOS
    eos_text: str
    controls: tuple[str, ...]  # the texts of the vocabulary's control tokens (`<|im_start|>`, `<end_of_turn>`)
    vocab_size: int
    n_layers: int
    n_experts: int | None  # None: a dense model
    quantization: str  # "" when the file does not say
    file_size: int
    metadata_end: int  # where the header and metadata stop: the vocabulary-only copy is bytes [0, metadata_end)
    alignment: int
    vocabulary_sha256: str  # what tokenizing depends on (see `_vocabulary_sha256`): files that share it count alike
    merges: Merges | None = field(
        default=None, repr=False, compare=False
    )  # None: no BPE merges (SentencePiece, WordPiece)


def gguf_facts(path: Path) -> GgufFacts:
    """Read a GGUF's facts; a file that is not a GGUF model raises GgufUnreadable saying why."""
    with path.open("rb") as file:
        head = file.read(_HEADER_BYTES)
    if len(head) < _HEADER_BYTES or head[:4] != GGUF_MAGIC:
        raise GgufUnreadable(f"{path} is not a GGUF file (it does not start with the GGUF magic)")
    try:  # parsed afresh, not through open_gguf's per-process cache: an add must see the file as it is now
        reader = _PlainArrayReader(str(path))
    except (ValueError, IndexError, OSError, EOFError) as error:
        raise GgufUnreadable(f"{path} is not a readable GGUF file ({error})") from None
    architecture = gguf_field(reader, "general.architecture")
    if not architecture:
        raise GgufUnreadable(f"{path} names no general.architecture: not a GGUF model")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise GgufUnreadable(f"{path} holds no vocabulary (tokenizer.ggml.tokens): its tokens cannot be counted")
    texts = tokens.contents()
    kinds = gguf_field(reader, "tokenizer.ggml.token_type") or []
    bos, eos = gguf_field(reader, "tokenizer.ggml.bos_token_id"), gguf_field(reader, "tokenizer.ggml.eos_token_id")
    context_length = gguf_field(reader, f"{architecture}.context_length")
    n_layers = gguf_field(reader, f"{architecture}.block_count")
    if not context_length or not n_layers:
        raise GgufUnreadable(f"{path} lacks {architecture}.context_length or {architecture}.block_count")
    return GgufFacts(
        architecture=architecture,
        context_length=int(context_length),
        chat_template=gguf_field(reader, "tokenizer.chat_template", ""),
        bos_token_id=bos,
        eos_token_id=eos,
        eot_token_id=gguf_field(reader, "tokenizer.ggml.eot_token_id"),
        bos_text=_token_text(texts, bos),
        eos_text=_token_text(texts, eos),
        controls=tuple(text for text, kind in zip(texts, kinds, strict=False) if kind == TokenType.CONTROL and text),
        vocab_size=len(tokens.data),
        n_layers=int(n_layers),
        n_experts=gguf_field(reader, f"{architecture}.expert_count") or None,
        quantization=_quantization(gguf_field(reader, "general.file_type")),
        file_size=path.stat().st_size,
        metadata_end=max(
            field.offset + sum(part.nbytes for part in field.parts)
            for key, field in reader.fields.items()
            if not key.startswith("GGUF.")
        ),
        alignment=int(gguf_field(reader, "general.alignment", GGUF_DEFAULT_ALIGNMENT)),
        vocabulary_sha256=_vocabulary_sha256(reader),
        merges=_merges(reader.fields.get(_MERGES)),
    )


_VOCABULARY_GENERAL = ("general.architecture", "general.name")  # what llama.cpp's vocabulary reads of general.*


def _vocabulary_sha256(reader: _PlainArrayReader) -> str:
    """A digest of everything llama.cpp's tokenizer is built from: the architecture, the model's
    name and every `tokenizer.*` entry (model, pre-tokenizer, tokens, types, scores, merges,
    special ids and flags) as their bytes in the file; chat templates left out (they render, they
    do not count). The name counts because llama.cpp reads it: Phi-3's control tokens take the
    newline after them only in a file whose name says phi-3 or phi3, so one vocabulary under two
    names can render a chat in two token counts. Two quantisations of one model (one name)
    share it, so the gateway keeps one vocabulary for all of them instead of one per file."""
    digest = hashlib.sha256()
    for key in sorted(reader.fields):
        if key in _VOCABULARY_GENERAL or (
            key.startswith("tokenizer.") and not key.startswith("tokenizer.chat_template")
        ):
            field = reader.fields[key]
            end = field.offset + sum(part.nbytes for part in field.parts)
            digest.update(key.encode() + b"\0" + reader.data[field.offset : end].tobytes())
    return digest.hexdigest()


def _merges(entry: ReaderField | None) -> Merges | None:
    """An array's parts are: key length, key, value type, item type, item count, then each
    item's length and bytes (`entry.data` indexes the items' bytes)."""
    if entry is None:
        return None
    parts = entry.parts
    return Merges(
        count_at=entry.offset + sum(part.nbytes for part in parts[:4]),
        end=entry.offset + sum(part.nbytes for part in parts),
        u64=parts[4].dtype.str,
        items=tuple(parts[index].tobytes() for index in entry.data),
    )


def _token_text(texts: list[str], token: int | None) -> str:
    return texts[token] if token is not None and 0 <= token < len(texts) else ""


def _quantization(file_type: int | None) -> str:
    """llama.cpp's name of the file type: 15 -> "Q4_K_M", 0 -> "F32"; "" when unknown."""
    if file_type is None:
        return ""
    try:
        name = LlamaFileType(file_type).name
    except ValueError:
        return ""
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def gguf_vocab_copy(path: Path, facts: GgufFacts, dest: Path) -> None:
    """Write `dest`: the file's header and metadata, byte for byte, declaring no tensors, with
    `tokenizer.ggml.merges` cut to the merges llama.cpp can apply (Llama 3's 280,147 to 127,156,
    about a third of what its vocabulary costs a gateway process in memory).

    Written beside `dest` and renamed into place, so a reader never sees half a copy."""
    with path.open("rb") as file:
        metadata = bytearray(file.read(facts.metadata_end))
    if facts.merges is not None:
        metadata[facts.merges.count_at : facts.merges.end] = _merges_encoded(facts.merges)
    metadata[_TENSOR_COUNT] = bytes(8)  # zero tensors: the same 0 in either byte order
    metadata += bytes(-len(metadata) % facts.alignment)  # the (empty) data section starts aligned
    partial = dest.with_name(f".{dest.name}.partial")
    try:
        partial.write_bytes(metadata)
        os.replace(partial, dest)
    finally:
        partial.unlink(missing_ok=True)


def _merges_encoded(merges: Merges) -> bytes:
    """The entry's item count and items as the file encodes them, holding only the merges
    llama.cpp can apply."""
    kept = merges_applicable(merges.items)
    u64 = np.dtype(merges.u64)
    return np.array([len(kept)], u64).tobytes() + b"".join(np.array([len(item)], u64).tobytes() + item for item in kept)
