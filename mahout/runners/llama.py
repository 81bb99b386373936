"""llama.cpp runner: one GGUF model loaded once, streaming one job at a time.

The prompt is rendered by :mod:`protocol.turns` (the same rendering the gateway counts),
tokenized here with ``special=True`` so Gemma's turn markers become control tokens, and
handed to llama-cpp-python as token ids. Passing ids lets us check the context window
before any compute and makes BOS explicit.
"""
from __future__ import annotations

import math
import threading
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, cast

from mahout.runners import RequestRejected
from protocol.jobs import CHAT
from protocol.turns import job_stop_strings, render_job

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    from llama_cpp import Llama, LogitsProcessorList

_PARAMS_LOCK = threading.Lock()


def cpu_advertises_amx(cpuinfo: str | None = None) -> bool:
    """True when /proc/cpuinfo lists AMX tiles, the case where ggml picks its AMX kernels."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    return any(line.startswith("flags") and " amx_tile" in line for line in cpuinfo.splitlines())


def load_llama(model_path: str | Path, *, n_ctx: int, threads: int, logits_all: bool = False) -> Llama:
    """Load a GGUF with llama-cpp-python, quietly, with ``threads`` for prompt and generation
    (``logits_all`` keeps every position's logits, for log-probabilities: the gateway's canary
    references).

    On CPUs that advertise AMX, ggml's extra (AMX/repack) weight buffers are turned off:
    virtual machines often advertise AMX without enabling its tile state, and the first
    AMX instruction then kills the process with SIGILL (seen on this project's build
    machine). ``Llama`` does not expose the switch, so its default model params are
    wrapped for the duration of the load, under a lock.
    """
    import llama_cpp.llama as llama_module

    with _PARAMS_LOCK:
        original = llama_module.llama_cpp.llama_model_default_params

        def params():
            defaults = original()
            defaults.use_extra_bufts = False
            return defaults

        if cpu_advertises_amx():
            llama_module.llama_cpp.llama_model_default_params = params
        try:
            return llama_module.Llama(
                model_path=str(model_path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False,
                logits_all=logits_all,
            )
        finally:
            llama_module.llama_cpp.llama_model_default_params = original


SAMPLING_RANGES = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0)}


def _number(params: dict, key: str, default: float) -> float:
    """``params[key]`` as a float, or ``default`` when absent or null (OpenAI's defaults are 1);
    RequestRejected when it is not a finite number in its range (the gateway checks this
    too: a request that reaches a host with one is the request's fault, not the host's)."""
    value = params.get(key)
    if value is None:
        return default
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise RequestRejected(f"{key} {value!r} is not a number") from None
    low, high = SAMPLING_RANGES.get(key, (-math.inf, math.inf))
    if not math.isfinite(number) or not low <= number <= high:
        raise RequestRejected(f"{key} {value!r} is outside [{low:g}, {high:g}]")
    return number


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

    def processors(self) -> LogitsProcessorList:
        import numpy as np
        from llama_cpp import LogitsProcessorList

        def rewrite_dropped_text(input_ids: npt.NDArray[np.intc], scores: npt.NDArray[np.single]) -> npt.NDArray[np.single]:
            produced = b"".join(self.vocab.pieces[t] for t in input_ids[self.prompt_len :])
            if len(produced) >= len(self.dropped):
                return scores
            return np.where(self.vocab.compatible(self.dropped[len(produced) :]), scores, -np.inf)

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


class ContextOverflowError(RequestRejected):
    """The rendered prompt does not fit in the model's context window."""


class LlamaRunner:
    """Streams completions for jobs from a GGUF model loaded once and reused."""

    def __init__(self, model_path: str | Path, threads: int, n_ctx: int = 4096) -> None:
        self.model_path = Path(model_path)
        self.n_ctx = n_ctx
        self._llm = load_llama(self.model_path, n_ctx=n_ctx, threads=threads)
        self.finish_reason = "stop"
        self.completion_tokens = 0
        self._vocab: Vocab | None = None
        # Healing needs every token's text (seconds to compute): build it while the host idles.
        self._vocab_ready = threading.Thread(target=self._build_vocab, name="mahout-vocab", daemon=True)
        self._vocab_ready.start()

    def _build_vocab(self) -> None:
        self._vocab = Vocab(self._llm)

    def close(self) -> None:
        """Free the model (the loading policy calls this on unload); waits for the vocab thread,
        which reads the model."""
        self._vocab_ready.join()
        self._llm.close()

    def _heal(self, tokens: list[int]) -> tuple[list[int], TokenHealer | None]:
        """Drop the tokens of the unfinished last word; the healer re-writes them."""
        self._vocab_ready.join()
        assert self._vocab is not None
        back = self._vocab.unfinished_word(tokens)
        if back == 0:
            return tokens, None
        dropped = b"".join(self._vocab.pieces[t] for t in tokens[-back:])
        return tokens[:-back], TokenHealer(prompt_len=len(tokens) - back, dropped=dropped, vocab=self._vocab)

    def prompt_tokens(self, job: dict) -> list[int]:
        """Token ids of the rendered job, BOS first; raises if they leave no room to generate."""
        tokens = self._llm.tokenize(render_job(job).encode("utf-8"), add_bos=True, special=True)
        if len(tokens) >= self.n_ctx:
            raise ContextOverflowError(
                f"prompt is {len(tokens)} tokens; the context window is {self.n_ctx} tokens"
            )
        return tokens

    @staticmethod
    def stop_strings(job: dict) -> list[str]:
        """The job's stop strings, plus Gemma's end of turn for chats."""
        return job_stop_strings(job)

    def _count(self, text: str) -> int:
        """Tokens in generated text, counted as the gateway counts them (re-tokenized)."""
        return len(self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)) if text else 0

    def stream(self, job: dict) -> Generator[str, None, None]:
        """Yield generated text pieces; afterwards ``finish_reason`` and ``completion_tokens`` hold.

        ``max_tokens`` is clamped to what the context window leaves, as llama.cpp does;
        a generation that hits that bound finishes with "length" and exactly that many tokens.
        A job that resumes text (see :func:`resumes_text`) is token-healed so it
        continues from the exact character, even mid-word.
        """
        params = job.get("params") or {}
        tokens = self.prompt_tokens(job)
        budget = self.n_ctx - len(tokens)
        max_tokens = min(int(params.get("max_tokens") or budget), budget)
        tokens, healer = self._heal(tokens) if resumes_text(job) else (tokens, None)
        self.finish_reason, self.completion_tokens = "stop", 0
        pieces: list[str] = []
        chunks = self._llm.create_completion(
            prompt=tokens,
            stream=True,
            max_tokens=max_tokens,
            temperature=_number(params, "temperature", 1.0),
            top_p=_number(params, "top_p", 1.0),
            stop=self.stop_strings(job),
            seed=params.get("seed"),
            logits_processor=healer.processors() if healer else None,
        )
        for chunk in cast(Iterator[dict], chunks):  # stream=True returns an iterator of chunks
            choice = chunk["choices"][0]
            text = healer.strip(choice["text"]) if healer else choice["text"]
            if text:
                pieces.append(text)
                yield text
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        text = "".join(pieces)
        self.completion_tokens = max_tokens if self.finish_reason == "length" else self._count(text)
