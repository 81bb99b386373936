"""Auditing a delivered answer under the real model: were its tokens drawn by the specified sampler?

A host draws every token of an answer by :mod:`protocol.sampling` with the job's seed and
reports the token ids with its answer. A :class:`Verifier` holding the same model rebuilds
the prompt's tokens exactly as a host does (:class:`~mahout.runners.llama.PromptTokenizer`),
checks that the ids spell the delivered text (and end where the finish reason says), then
recomputes the logits of prompt + answer in one prefill pass and asks of each answer token
whether the draw ``uniform(seed, position)`` selects it (:func:`protocol.sampling.token_check`).
A token the prefill finds missing is looked at again with the answer decoded one token at a
time, as the host ran it (:meth:`Verifier._second_look`): some CPUs' batched kernels differ
from their one-token kernels by more than the tie gap.

The prefill asks llama.cpp for logits only at the positions that predict an answer token, a
batch of ``n_batch`` tokens at a time, and checks each position as soon as its batch is
decoded: nothing of the size ``n_ctx × n_vocab`` is ever allocated.

Pass rule: no token may miss. Honest machines whose logits differ in their last digits
(threads, batch sizes) give near-ties and near-edges, which are ``uncertain``, never misses
(measured in ``bench/trust.py``: 0 misses over every honest answer), while every cheat measured
there misses many tokens of each answer.

Which jobs can be audited (:func:`auditable`): free text (no ``response_format``: its grammar
path draws otherwise), not a continuation or rewrite, and not a chat that ends in an
assistant turn (the host heals its cut last word first, which this verifier does not redo).
No Django here: the gateway's workers or a trusted host run it.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mahout.runners.llama import PromptTokenizer, load_llama, resumes_text
from protocol.jobs import CHAT, COMPLETION, job_stop_strings
from protocol.sampling import MATCH, MISS, TIE_GAP, TOLERANCE, token_check, uniform

if TYPE_CHECKING:
    from llama_cpp import Llama

INCOMPLETE_UTF8_MAX = 3  # bytes a stream may hold back at the end: an unfinished character


class Unauditable(ValueError):
    """The job cannot be audited here (see :func:`auditable`, or its answer outgrows the context)."""


@dataclass
class Audit:
    """One answer's audit: tokens checked, matched and uncertain, the misses as (index in the
    answer, token, margin), and why it fails (None: it passes)."""

    checked: int = 0
    matched: int = 0
    uncertain: int = 0
    misses: list[tuple[int, int, float]] = field(default_factory=list)
    reason: str | None = None

    @property
    def passed(self) -> bool:
        return self.reason is None


def auditable(job: dict) -> bool:
    """True for a job whose answer this verifier can check token by token."""
    params = job.get("params") or {}
    return (job.get("kind") in (CHAT, COMPLETION) and not params.get("response_format")
            and not job.get("continuation") and not job.get("rewrite") and not resumes_text(job))


def _sampling(params: dict, key: str) -> float:
    value = params.get(key)
    return 1.0 if value is None else float(value)


class Verifier:
    """The shipped model (or any GGUF) loaded once, as hosts load it, to audit answers; or
    (``llm``) a model a runner loaded already, borrowed and never closed here (`mahout.scoring`)."""

    def __init__(self, model_path: str | Path | None, *, threads: int, n_ctx: int = 4096, llm: Llama | None = None,
                 tolerance: float = TOLERANCE, tie_gap: float = TIE_GAP) -> None:
        import llama_cpp

        self._lib = llama_cpp
        self._llm: Llama = llm if llm is not None else load_llama(model_path, n_ctx=n_ctx, threads=threads)
        self._owns_llm = llm is None
        self._prompt = PromptTokenizer(self._llm)
        self.n_ctx, self.n_vocab = n_ctx, self._llm.n_vocab()
        self.n_batch = int(llama_cpp.llama_n_batch(self._llm.ctx))
        self.tolerance, self.tie_gap = tolerance, tie_gap
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)

    def close(self) -> None:
        if self._batch is not None:
            self._lib.llama_batch_free(self._batch)
            self._batch = None
        if self._owns_llm:
            self._llm.close()

    def __enter__(self) -> Verifier:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def audit(self, job: dict, *, token_ids: list[int], text: str, finish_reason: str, seed: int,
              sample: int | None = None) -> Audit:
        """Check a delivered answer: ``token_ids`` as the host reported them, ``text`` as the
        customer received it. Every token is checked, or with ``sample`` that many drawn at
        random (unpredictable to the host; the rest are prefilled without their logits, which
        for a large vocabulary are most of an audit's cost). Raises :class:`Unauditable` for a
        job :func:`auditable` refuses or a prompt + answer longer than the context."""
        if not auditable(job):
            raise Unauditable("only free-text jobs that start a fresh answer are audited")
        params = job.get("params") or {}
        prompt = self._prompt.tokens(job)
        reason = self._spelling(job, prompt, token_ids, text, finish_reason)
        if reason:
            return Audit(reason=reason)
        if len(prompt) + len(token_ids) - 1 > self.n_ctx:
            raise Unauditable(f"{len(prompt)} + {len(token_ids)} tokens do not fit in {self.n_ctx}")
        checked = set(range(len(token_ids)))
        if sample is not None and sample < len(token_ids):
            checked = set(random.SystemRandom().sample(sorted(checked), max(sample, 0)))
        sampling = {"seed": seed, "temperature": _sampling(params, "temperature"), "top_p": _sampling(params, "top_p")}
        audit = self._replay(prompt, token_ids, checked, **sampling)
        if audit.misses:
            self._second_look(prompt, token_ids, audit, **sampling)
        if audit.misses:
            index, token, margin = audit.misses[0]
            audit.reason = (f"{len(audit.misses)} of {audit.checked} tokens are not what the seeded draw selects "
                            f"(the first at token {index}, id {token}, by {margin:.3g})")
        return audit

    def _spelling(self, job: dict, prompt: list[int], token_ids: list[int], text: str, finish_reason: str) -> str | None:
        """Why ``token_ids`` are not the answer delivered as ``text`` with ``finish_reason`` (None: they are).

        As llama.cpp ends an answer: the ids spell the text (as bytes); no token before the
        last completes a stop string; "stop" ends in one end-of-generation token, or in the
        token that completes a stop string (the text ends where that stop string starts);
        "length" means ``max_tokens`` tokens (or a full context). An unfinished character at
        the end may be held back from the text."""
        if not token_ids:
            return "no token ids were reported"
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.n_vocab for t in token_ids):
            return "a reported token id is not in the model's vocabulary"
        vocab = self._lib.llama_model_get_vocab(self._llm.model)
        if any(self._lib.llama_vocab_is_eog(vocab, t) for t in token_ids[:-1]):
            return "tokens continue past an end of generation"
        ended = bool(self._lib.llama_vocab_is_eog(vocab, token_ids[-1]))
        sampled = token_ids[:-1] if ended else token_ids
        max_tokens = int((job.get("params") or {}).get("max_tokens") or self.n_ctx)
        if len(sampled) > max_tokens:
            return f"{len(sampled)} tokens where max_tokens is {max_tokens}"
        spelled, delivered = self._llm.detokenize(sampled), text.encode("utf-8")
        if not spelled.startswith(delivered):
            return "the token ids do not spell the delivered text"
        rest = spelled[len(delivered):]
        stops = [s.encode("utf-8") for s in job_stop_strings(job) if s]
        if sampled and any(stop in self._llm.detokenize(sampled[:-1]) for stop in stops):
            return "tokens continue past a stop string"
        if finish_reason == "stop" and not ended:
            if not any(rest.startswith(stop) for stop in stops):
                return "'stop' with neither an end of generation nor a stop string: the answer was cut short"
            return None
        if any(stop in spelled for stop in stops):
            return "tokens continue past a stop string"
        if not _held_back(rest):
            return "the token ids spell more than the delivered text"
        if finish_reason == "length" and (ended or (len(sampled) < max_tokens and len(prompt) + len(sampled) < self.n_ctx)):
            return f"'length' after {len(sampled)} of {max_tokens} tokens" + (" and an end of generation" if ended else "")
        if finish_reason not in ("stop", "length"):
            return f"unknown finish reason {finish_reason!r}"
        return None

    def _replay(self, prompt: list[int], answer: list[int], checked: set[int], *, seed: int, temperature: float,
                top_p: float) -> Audit:
        """One prefill pass over prompt + answer (not its last token), checking each answer token
        of ``checked`` (indices) at the position that predicts it, as soon as that position's
        logits are computed (llama.cpp computes logits only there)."""
        import numpy as np

        lib, ctx, batch = self._lib, self._llm.ctx, self._batch
        lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
        sequence = prompt + answer[:-1]
        first = len(prompt) - 1  # the position whose logits predict answer[0]
        audit = Audit()
        for start in range(0, len(sequence), self.n_batch):
            chunk = sequence[start:start + self.n_batch]
            batch.n_tokens = len(chunk)
            for i, token in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, start + i, 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = start + i + 1 - len(prompt) in checked
            if lib.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed during an audit")
            for i in range(max(first - start, 0), len(chunk)):
                position = start + i + 1  # of the answer token these logits predict
                index = position - len(prompt)
                if index not in checked:
                    continue
                logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, i), shape=(self.n_vocab,))
                audit.checked += 1
                self._tally(audit, audit.misses, logits, answer, index, position, seed=seed, temperature=temperature,
                            top_p=top_p)
        return audit

    def _tally(self, audit: Audit, misses: list, logits: object, answer: list[int], index: int, position: int, *,
               seed: int, temperature: float, top_p: float) -> None:
        """Check answer[index] (drawn at `position`) against `logits`: a match or an uncertain
        token is counted on `audit`, a miss appended to `misses`."""
        check = token_check(logits, answer[index], temperature=temperature, top_p=top_p,
                            u=uniform(seed, position), tolerance=self.tolerance, tie_gap=self.tie_gap)
        if check.verdict == MATCH:
            audit.matched += 1
        elif check.verdict == MISS:
            misses.append((index, answer[index], check.margin))
        else:
            audit.uncertain += 1


    def _second_look(self, prompt: list[int], answer: list[int], audit: Audit, *, seed: int, temperature: float,
                     top_p: float) -> None:
        """Check the prefill's misses again with logits computed as a host computes them: the
        prompt prefilled alone, then the answer decoded one token at a time. On some CPUs
        llama.cpp's batched kernels differ from its one-token kernels by about a logit (0.8 median
        on an AVX-512/AMX Xeon), far more than ``tie_gap`` allows, and a prompt's rows computed in
        a batch with the answer differ from its rows computed alone. Only answers with a miss pay
        for this; a token missed here too stays a miss."""
        import numpy as np

        lib, ctx, batch = self._lib, self._llm.ctx, self._batch
        missed = {index for index, _, _ in audit.misses}
        lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
        kept: list[tuple[int, int, float]] = []
        sequence = prompt + answer[:max(missed)]
        start = 0
        while start < len(sequence):
            # the prompt in n_batch chunks, as llama-cpp-python evaluates it; then one token at a time
            size = min(self.n_batch, len(prompt) - start) if start < len(prompt) else 1
            begin, chunk = start, sequence[start:start + size]
            start += len(chunk)
            batch.n_tokens = len(chunk)
            for i, token in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, begin + i, 1, i == len(chunk) - 1
                batch.seq_id[i][0] = 0
            if lib.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed during an audit")
            position = start  # of the token the last row's logits predict
            index = position - len(prompt)
            if index not in missed:
                continue
            logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, len(chunk) - 1), shape=(self.n_vocab,))
            self._tally(audit, kept, logits, answer, index, position, seed=seed, temperature=temperature, top_p=top_p)
        audit.misses = kept


def _held_back(rest: bytes) -> bool:
    """True when ``rest`` is nothing, or only the start of a character a stream holds back."""
    return len(rest) <= INCOMPLETE_UTF8_MAX and rest.decode("utf-8", errors="ignore") == ""
