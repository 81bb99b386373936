"""Text a job resumes, healed: a host drops the tokens of the prompt's cut last word (or takes
a whole `rewrite`) and writes that text again under a mask before the model runs free; the
verifier replays the same mask (`scorer.verify`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol.jobs import CHAT

if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy as np
    import numpy.typing as npt
    from llama_cpp import Llama, LogitsProcessorList


def resumes_text(job: dict) -> bool:
    """True for a job that must continue existing text from its exact last
    character: a chat ending in an assistant turn, or a continuation job."""
    if job.get("continuation"):
        return True
    messages = job.get("messages") or []
    return job.get("kind") == CHAT and bool(messages) and messages[-1].get("role") == "assistant"


class TokenHealer:
    """Token healing for text cut at an arbitrary character.

    A prompt that ends mid-word ("…one paragr") tokenizes into pieces the model
    rarely saw (" par" + "agr") where it would have written one token
    (" paragraph"), so it continues badly. The healer drops the tokens of the
    unfinished word and constrains generation to re-write exactly that text
    (any token that starts with what is still missing, or is a prefix of it),
    then lets the model run free; the re-written text is stripped from the
    output, so only new characters are streamed.
    """

    MAX_TOKENS_BACK = 4

    def __init__(self, *, prompt_len: int, dropped: bytes, vocab: Vocab) -> None:
        self.prompt_len = prompt_len
        self.dropped = dropped
        self.vocab = vocab
        self.pending = dropped.decode("utf-8", errors="ignore")

    def mask(self, produced: bytes) -> npt.NDArray[np.bool_] | None:
        """The tokens allowed next once ``produced`` (the bytes generated so far) is written:
        those compatible with the text still to re-write (None: it is all written, any token is)."""
        if len(produced) >= len(self.dropped):
            return None
        return self.vocab.compatible(self.dropped[len(produced) :])

    def allows(self, produced: bytes, token: int) -> bool:
        """Whether :meth:`mask` after ``produced`` allows ``token``."""
        return len(produced) >= len(self.dropped) or self.vocab.fits(token, self.dropped[len(produced) :])

    def processors(self) -> LogitsProcessorList:
        import numpy as np
        from llama_cpp import LogitsProcessorList

        def rewrite_dropped_text(
            input_ids: npt.NDArray[np.intc], scores: npt.NDArray[np.single]
        ) -> npt.NDArray[np.single]:
            allowed = self.mask(b"".join(self.vocab.pieces[t] for t in input_ids[self.prompt_len :]))
            return scores if allowed is None else np.where(allowed, scores, -np.inf)

        return LogitsProcessorList([rewrite_dropped_text])

    def strip(self, text: str) -> str:
        """Remove the re-written text from the start of the output stream."""
        if not self.pending:
            return text
        if text.startswith(self.pending):
            text, self.pending = text[len(self.pending) :], ""
            return text
        if self.pending.startswith(text):
            self.pending = self.pending[len(text) :]
            return ""
        self.pending = ""
        return text


class Vocab:
    """Every token's bytes, for healing: computed once per model (about a second)."""

    def __init__(self, llm: Llama) -> None:
        self.pieces = [llm.detokenize([i], special=False) for i in range(llm.n_vocab())]
        self._by_piece: dict[bytes, list[int]] = {}
        for token, piece in enumerate(self.pieces):
            self._by_piece.setdefault(piece, []).append(token)

    def compatible(self, missing: bytes) -> npt.NDArray[np.bool_]:
        """[n_vocab] bool: tokens that start with `missing`, or are a non-empty prefix of it."""
        import numpy as np

        mask = np.fromiter((piece.startswith(missing) for piece in self.pieces), dtype=bool, count=len(self.pieces))
        for end in range(1, len(missing)):
            for token in self._by_piece.get(missing[:end], ()):
                mask[token] = True
        return mask

    def fits(self, token: int, missing: bytes) -> bool:
        """``compatible(missing)[token]``, for one token (a verifier replaying a healer asks
        about the token drawn, not the vocabulary)."""
        piece = self.pieces[token]
        return bool(piece) and (piece.startswith(missing) or missing.startswith(piece))

    def unfinished_word(self, tokens: list[int]) -> int:
        """How many trailing tokens spell the last (possibly cut) word, 0 if none."""
        count = 0
        while count < TokenHealer.MAX_TOKENS_BACK and len(tokens) - count > 2:
            piece = self.pieces[tokens[-1 - count]]
            if not piece or b"\n" in piece or piece.startswith(b"<"):
                break
            count += 1
            if piece[:1].isspace():
                break
        return count


def healing(job: dict, tokens: list[int], vocab: Vocab) -> tuple[list[int], TokenHealer | None]:
    """What a host feeds for ``job`` whose prompt is ``tokens``, and the healer that re-writes
    text before the model runs free (None: nothing to re-write). A ``rewrite`` (a continuation
    under a grammar) is written again whole after the prompt; text a job resumes (see
    :func:`resumes_text`) loses the tokens of its unfinished last word, which are written again."""
    rewrite = job.get("rewrite") or ""
    if rewrite:
        return tokens, TokenHealer(prompt_len=len(tokens), dropped=rewrite.encode("utf-8"), vocab=vocab)
    back = vocab.unfinished_word(tokens) if resumes_text(job) else 0
    if back == 0:
        return tokens, None
    dropped = b"".join(vocab.pieces[t] for t in tokens[-back:])
    return tokens[:-back], TokenHealer(prompt_len=len(tokens) - back, dropped=dropped, vocab=vocab)


def rewrite_budget(job: dict, max_tokens: int, count: Callable[[str], int]) -> int:
    """The tokens a host may generate for ``job`` given its ``max_tokens`` (clamped to the
    context): a ``rewrite`` is written again first, so its tokens (by ``count``) and a few
    more (a token may split differently when written again) are added."""
    rewrite = job.get("rewrite") or ""
    return max_tokens + count(rewrite) + 4 if rewrite else max_tokens
