"""llama.cpp runner: one GGUF model loaded once, streaming one job at a time.

The prompt arrives rendered by the gateway in the model's own chat template (the job's
`fragments`, :mod:`protocol.rendering`: the rendering the gateway counted), is tokenized
here by :class:`~scorer.llama.PromptTokenizer` (text as text, each of the template's control tokens as
itself: a customer's text never becomes one), and is handed to llama-cpp-python as token
ids. Passing ids lets us check the context window before any compute.

llama-cpp-python keeps the last prompt's KV and reuses the prefix the next prompt shares with
it. A job that starts ``prompt_cache_seconds`` (PROMPT_CACHE_SECONDS) or more after the last one
ended starts from a cleared cache instead: a customer's prompt is not reused past the bound the
gateway promises.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, cast

from mahout.runners import Piece, job_number, job_seed
from mahout.runners.logprobs import LogprobRecorder, TokenAligner
from protocol.jobs import job_stop_strings
from protocol.sampling import select, select_masked, uniform
from protocol.timing import PROMPT_CACHE_SECONDS
from scorer.errors import RequestRejected
from scorer.healing import TokenHealer, Vocab, healing, resumes_text, rewrite_budget
from scorer.llama import Grammar, PromptTokenizer, count_tokens, grammar_for, load_llama

if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy as np
    import numpy.typing as npt
    from llama_cpp import Llama


class GrammarSampler:
    """The specified sampler under a grammar, as a logits processor: the token at position
    ``len(input_ids)`` is :func:`protocol.sampling.select_masked`'s draw with
    ``uniform(seed, position)`` over the tokens the grammar allows (after the tokens generated
    so far, fed to it before each draw), then left the only finite score, as
    :class:`SpecifiedSampler` does. Exactly the draw over the masked logits, so a verifier
    replaying the grammar checks it like any other."""

    def __init__(self, grammar: Grammar, *, prompt_len: int, seed: int, temperature: float, top_p: float) -> None:
        self.grammar = grammar
        self._seen = prompt_len
        self.seed, self.temperature, self.top_p = seed, temperature, top_p
        self.token_ids: list[int] = []  # each token chosen, in order

    def __call__(self, input_ids: npt.NDArray[np.intc], scores: npt.NDArray[np.single]) -> npt.NDArray[np.single]:
        import numpy as np

        for token in input_ids[self._seen :]:
            self.grammar.accept(int(token))
        self._seen = len(input_ids)
        choice = select_masked(
            scores,
            self.grammar.allowed,
            temperature=self.temperature,
            top_p=self.top_p,
            u=uniform(self.seed, len(input_ids)),
        )
        self.token_ids.append(choice)
        only = np.full_like(scores, -np.inf)
        only[choice] = scores[choice] if np.isfinite(scores[choice]) else 0.0
        return only


class SpecifiedSampler:
    """The specified sampler (:mod:`protocol.sampling`) as a logits processor: the token at
    position ``len(input_ids)`` is ``select(scores, u=uniform(seed, position))``, and it is left
    the only finite score, so llama.cpp's own sampler picks it.
    Placed last: after the log-probability recorder has read the model's own scores and after
    a healer's mask. ``token_ids`` records each token chosen, the last one (an end of
    generation, or the token that completed a stop string) included: what a verifier checks."""

    def __init__(self, *, seed: int, temperature: float, top_p: float) -> None:
        self.seed, self.temperature, self.top_p = seed, temperature, top_p
        self.token_ids: list[int] = []
        self._only: npt.NDArray[np.single] | None = None  # -inf but at the last choice (reused: no allocation a token)

    def __call__(self, input_ids: npt.NDArray[np.intc], scores: npt.NDArray[np.single]) -> npt.NDArray[np.single]:
        import numpy as np

        token = select(scores, temperature=self.temperature, top_p=self.top_p, u=uniform(self.seed, len(input_ids)))
        if self._only is None:
            self._only = np.full(len(scores), -np.inf, dtype=np.single)
        elif self.token_ids:
            self._only[self.token_ids[-1]] = -np.inf
        self.token_ids.append(token)
        self._only[token] = scores[token] if np.isfinite(scores[token]) else 0.0
        return self._only


def end_of_generation_ids(llm: Llama) -> frozenset[int]:
    """Every token llama.cpp ends a generation at (`llama_vocab_is_eog`: EOS, EOT and the like,
    e.g. Qwen's `<|im_end|>` and `</s>`), for a host that samples outside llama.cpp's loop (a
    ring, an MoE coordinator) to stop where a single-machine host stops."""
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    return frozenset(token for token in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, token))


class ContextOverflowError(RequestRejected):
    """The rendered prompt does not fit in the model's context window."""


class LlamaRunner:
    """Streams completions for jobs from a GGUF model loaded once and reused."""

    def __init__(
        self,
        model_path: str | Path,
        threads: int,
        n_ctx: int = 4096,
        gpu_layers: int = 0,
        *,
        prompt_cache_seconds: float = PROMPT_CACHE_SECONDS,
    ) -> None:
        self.model_path = Path(model_path)
        self.n_ctx = n_ctx
        self.prompt_cache_seconds = prompt_cache_seconds
        self._last_job_at: float | None = None  # time.monotonic() when the last job ended (its prompt's KV held)
        self._last_cache_key = ""  # the last job's `cache_key`: a job of another key starts from a cleared KV
        self._llm = load_llama(self.model_path, n_ctx=n_ctx, threads=threads, gpu_layers=gpu_layers)
        self._prompt = PromptTokenizer(self._llm)
        self.prompt_count = 0  # the last job's prompt tokens
        self.finish_reason = "stop"
        self.completion_tokens = 0
        self.seed: int | None = None  # the last job's sampling seed (its own, or drawn here when it had none)
        self.token_ids: list[int] = []  # the last job's generated token ids, as sampled
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

    def _forget_stale_prompt(self, job: dict) -> None:
        """Clear the last prompt's KV (and the ids llama-cpp-python matches against) once it has
        been held ``prompt_cache_seconds`` unused, or before a job of another account
        (``JobPayload.cache_key``): llama-cpp-python reuses whatever prefix matches."""
        import llama_cpp

        key = str(job.get("cache_key") or "")
        same, self._last_cache_key = key == self._last_cache_key, key
        if self._last_job_at is None or (same and time.monotonic() - self._last_job_at < self.prompt_cache_seconds):
            return
        self._llm.reset()
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self._llm.ctx), True)
        self._llm.input_ids[:] = 0
        self._last_job_at = None

    def _healing(self, job: dict, tokens: list[int]) -> tuple[list[int], TokenHealer | None]:
        """:func:`healing`, waiting for the vocabulary only for a job that re-writes text."""
        if not (job.get("rewrite") or resumes_text(job)):
            return tokens, None
        self._vocab_ready.join()
        assert self._vocab is not None
        return healing(job, tokens, self._vocab)

    def prompt_tokens(self, job: dict) -> list[int]:
        """Token ids of the rendered job; raises if they leave no room to generate."""
        tokens = self._prompt.tokens(job)
        self.prompt_count = len(tokens)
        if len(tokens) >= self.n_ctx:
            raise ContextOverflowError(f"prompt is {len(tokens)} tokens; the context window is {self.n_ctx} tokens")
        return tokens

    @staticmethod
    def stop_strings(job: dict) -> list[str]:
        """The job's stop strings, plus its model's end of turn for chats."""
        return job_stop_strings(job)

    def stream(self, job: dict) -> Generator[str, None, None]:
        """Yield generated text pieces; afterwards ``finish_reason``, ``completion_tokens``,
        ``token_ids`` (every token sampled, a final end of generation included) and ``seed`` hold.

        ``max_tokens`` is clamped to what the context window leaves, as llama.cpp does;
        a generation that hits that bound finishes with "length" and exactly that many tokens.
        A job that resumes text (see :func:`resumes_text`) is token-healed so it
        continues from the exact character, even mid-word. Every token is drawn by the
        specified sampler with the job's seed (one drawn here when the job has none: an older
        gateway's): :class:`SpecifiedSampler`, or under a grammar :class:`GrammarSampler`.
        """
        params = job.get("params") or {}
        self._forget_stale_prompt(job)
        tokens = self.prompt_tokens(job)
        budget = self.n_ctx - len(tokens)
        max_tokens = min(int(params.get("max_tokens") or budget), budget)
        grammar = grammar_for(params.get("response_format"))
        rewrite = job.get("rewrite") or ""  # a continuation under a grammar: the delivered text, written again unseen
        max_tokens = min(rewrite_budget(job, max_tokens, lambda text: count_tokens(self._llm, text)), budget)
        tokens, healer = self._healing(job, tokens)
        self.finish_reason, self.completion_tokens = "stop", 0
        pieces: list[str] = []
        from llama_cpp import LogitsProcessorList

        temperature, top_p = job_number(params, "temperature", 1.0), job_number(params, "top_p", 1.0)
        self.seed = job_seed(params)
        recorder = aligner = None
        if params.get("logprobs") is not None:  # first: it reads the model's own scores
            self._vocab_ready.join()
            assert self._vocab is not None
            recorder = LogprobRecorder(prompt_len=len(tokens), top=int(params["logprobs"]))
            aligner = TokenAligner(recorder, self._vocab.pieces, skip=len(healer.pending) if healer else 0)
        processors: list[Callable[[npt.NDArray[np.intc], npt.NDArray[np.single]], npt.NDArray[np.single]]]
        processors = [recorder] if recorder else []
        processors += list(healer.processors()) if healer else []
        matcher = None
        if grammar is not None:
            matcher = Grammar(self._llm, grammar)
            sampler: GrammarSampler | SpecifiedSampler = GrammarSampler(
                matcher, prompt_len=len(tokens), seed=self.seed, temperature=temperature, top_p=top_p
            )
        else:
            sampler = SpecifiedSampler(seed=self.seed, temperature=temperature, top_p=top_p)
        processors.append(sampler)  # last: it chooses the token
        self.token_ids = sampler.token_ids
        chunks = self._llm.create_completion(
            prompt=tokens,
            stream=True,
            max_tokens=max_tokens,
            temperature=0.0,  # llama.cpp's sampler takes the one token left finite: its greedy pick costs least
            stop=self.stop_strings(job),
            logits_processor=LogitsProcessorList(processors),
        )
        try:
            for chunk in cast(Iterator[dict], chunks):  # stream=True returns an iterator of chunks
                choice = chunk["choices"][0]
                if aligner is not None:  # text cut on token boundaries, with its tokens' entries
                    text, entries = aligner.feed(choice["text"])
                    if text or entries:
                        pieces.append(text)
                        yield Piece(text, entries)
                else:
                    text = healer.strip(choice["text"]) if healer else choice["text"]
                    if text:
                        pieces.append(text)
                        yield text
                if choice.get("finish_reason"):
                    self.finish_reason = choice["finish_reason"]
            if aligner is not None:
                text, entries = aligner.finish()
                if text or entries:
                    pieces.append(text)
                    yield Piece(text, entries)
        finally:
            self._last_job_at = time.monotonic()
            if matcher is not None:
                matcher.close()
        text = "".join(pieces)
        self.completion_tokens = (
            max_tokens if self.finish_reason == "length" and not rewrite else count_tokens(self._llm, text)
        )
