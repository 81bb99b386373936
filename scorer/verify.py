"""Auditing a delivered answer under the real model: were its tokens drawn by the specified sampler?

A host draws every token of an answer by :mod:`protocol.sampling` with the job's seed and
reports the token ids with its answer. A :class:`Verifier` holding the same model rebuilds
the prompt's tokens exactly as a host does (:class:`~scorer.llama.PromptTokenizer`),
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

Every chat and completion job can be audited (:func:`auditable`), the constraints a host draws
under replayed as it ran them:

- **Structured output** (``response_format``, tools): the host draws over the tokens the
  grammar allows (:class:`~mahout.runners.llama.GrammarSampler`). The verifier builds the same
  grammar and feeds it the delivered tokens in order; at each checked token it makes the draw
  over the masked prefill logits (:func:`protocol.sampling.select_masked`, which asks the
  grammar about the likeliest tokens first) and, when that draw is another token, checks the
  token against the whole masked distribution. A token the grammar forbids is a miss outright
  (and ends the audit: the grammar cannot go past it).
- **Resumed text** (a continuation, a chat ending in an assistant turn, a ``rewrite``): the
  verifier rebuilds what the host fed (:func:`~scorer.healing.healing`: the prompt
  without the tokens of its cut last word, or the prompt then the whole ``rewrite``), checks
  that the ids spell the re-written text then the delivered text, and checks every token that
  ends at or past the end of the re-written text: the newly generated part, the token that
  completes a healed word included (drawn under the healer's mask, replayed). Tokens wholly
  inside the re-written text are not checked (they write again text the customer already has,
  and must spell it).
- **Log-probabilities** (``logprobs`` asked): each reported entry of a checked token is
  compared with the prefill's log-softmax (the model's own distribution, before any mask,
  as the host's recorder reads it): the token's value and the alternatives' values, best
  first. One further than ``LOGPROB_TOLERANCE`` (after the second look) fails the audit.

No Django here: the gateway's workers or a trusted host run it.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from protocol.catalog import AUDITABLE_CONTEXT_TOKENS
from protocol.grammar_fence import FenceUnavailable
from protocol.jobs import CHAT, COMPLETION, job_stop_strings
from protocol.sampling import MATCH, MISS, TIE_GAP, TOLERANCE, select_masked, token_check, uniform
from scorer.errors import RequestRejected
from scorer.healing import TokenHealer, Vocab, healing, resumes_text, rewrite_budget
from scorer.llama import Grammar, PromptTokenizer, count_tokens, grammar_for, load_llama

if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy as np
    import numpy.typing as npt
    from llama_cpp import Llama

INCOMPLETE_UTF8_MAX = 3  # bytes a stream may hold back at the end: an unfinished character
# How far a reported log-probability may be from the prefill's, in nats. Honest hosts compute
# it from their one-token decode, the verifier from its batched prefill (then from a one-token
# decode on a second look); measured on the shipped model (bench/trust.py --logprobs): see
# BENCHMARKS. A cheat's invented values (a constant, another model's) are off by more.
LOGPROB_TOLERANCE = 1.0
LOGPROB_FLOOR = -9999.0  # what a host reports for a value too small to be a number (OpenAI's)


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


def auditable(job: Mapping[str, Any]) -> bool:
    """True for a job whose answer this verifier can check token by token: every chat and
    completion, under a grammar or not, a fresh answer or one that resumes text (the newly
    generated part is checked; see the module's docstring). :meth:`Verifier.audit` may still
    find one it cannot check (a grammar this machine cannot build, an answer past its context)
    and raise :class:`Unauditable`."""
    return job.get("kind") in (CHAT, COMPLETION)


def _sampling(params: dict, key: str) -> float:
    value = params.get(key)
    return 1.0 if value is None else float(value)


class _Constraint:
    """What narrowed the host's draws, replayed over the answer token by token as its logits
    processors ran: a ``response_format``'s grammar (every token) and a healer re-writing text
    (the tokens until that text is written again)."""

    def __init__(self, llm: Llama, grammar: object | None, healer: TokenHealer | None) -> None:
        self._llm, self._spec, self.healer = llm, grammar, healer
        self.grammar: Grammar | None = None
        self.restart()

    def restart(self) -> None:
        """Back to the answer's start (a second look replays it again)."""
        self.close()
        self.grammar = Grammar(self._llm, self._spec) if self._spec is not None else None
        self._produced = b""

    def close(self) -> None:
        if self.grammar is not None:
            self.grammar.close()
            self.grammar = None

    def refusal(self, token: int) -> str | None:
        """Why the host could not have drawn ``token`` next (None: it could)."""
        import numpy as np

        if self.healer is not None and not self.healer.allows(self._produced, token):
            return "does not write again the text it resumes"
        if self.grammar is not None and not self.grammar.allowed(np.array([token], dtype=np.intp))[0]:
            return "is one the response_format's grammar forbids"
        return None

    def masked(self, logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """``logits`` as the host's sampler saw them: under the healer's mask while it re-writes."""
        import numpy as np

        allowed = self.healer.mask(self._produced) if self.healer is not None else None
        return logits if allowed is None else np.where(allowed, logits, np.float32(-np.inf))

    def advance(self, token: int) -> None:
        """Past ``token`` (which :meth:`refusal` allowed)."""
        if self.grammar is not None:
            self.grammar.accept(token)
        if self.healer is not None and len(self._produced) < len(self.healer.dropped):
            self._produced += self.healer.vocab.pieces[token]


@dataclass
class _Answer:
    """An answer as the audit replays it: its tokens, the draw's parameters, the constraint its
    host drew under, and the reported log-probability entries by token index."""

    tokens: list[int]
    seed: int
    temperature: float
    top_p: float
    constraint: _Constraint
    entries: dict[int, dict] = field(default_factory=dict)
    last_own: bool = True  # the last token's own value was recorded at its step (an end of generation follows it)


class Verifier:
    """The shipped model (or any GGUF) loaded once, as hosts load it, to audit answers
    (``gpu_layers`` of its layers on a GPU, as a host offloads them); or (``llm``) a model a
    runner loaded already, borrowed and never closed here (`mahout.scoring`)."""

    def __init__(
        self,
        model_path: str | Path | None,
        *,
        threads: int,
        n_ctx: int = AUDITABLE_CONTEXT_TOKENS,
        llm: Llama | None = None,
        tolerance: float = TOLERANCE,
        tie_gap: float = TIE_GAP,
        logprob_tolerance: float = LOGPROB_TOLERANCE,
        gpu_layers: int = 0,
    ) -> None:
        import llama_cpp

        self._lib = llama_cpp
        if llm is None:
            assert model_path is not None, "a Verifier reads model_path when it is given no llm"
            self._llm: Llama = load_llama(model_path, n_ctx=n_ctx, threads=threads, gpu_layers=gpu_layers)
        else:
            self._llm = llm
        self._owns_llm = llm is None
        self._prompt = PromptTokenizer(self._llm)
        self.n_ctx, self.n_vocab = n_ctx, self._llm.n_vocab()
        self.n_batch = int(llama_cpp.llama_n_batch(self._llm.ctx))
        self.tolerance, self.tie_gap, self.logprob_tolerance = tolerance, tie_gap, logprob_tolerance
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self._vocab: Vocab | None = None  # every token's bytes: built on the first audit that needs them

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

    @property
    def vocab(self) -> Vocab:
        if self._vocab is None:
            self._vocab = Vocab(self._llm)
        return self._vocab

    def audit(
        self,
        job: dict,
        *,
        token_ids: list[int],
        text: str,
        finish_reason: str,
        seed: int,
        sample: int | None = None,
        logprobs: list[dict] | None = None,
    ) -> Audit:
        """Check a delivered answer: ``token_ids`` as the host reported them (a re-written start
        included), ``text`` as the customer received it from this host (for a continuation: the
        new part only), and ``logprobs`` the entries reported with it when the job asked for
        them. Every newly generated token is checked, or with ``sample`` that many drawn at
        random (unpredictable to the host; the rest are prefilled without their logits, which
        for a large vocabulary are most of an audit's cost, and nothing after the last one
        drawn is prefilled at all). Raises :class:`Unauditable` for a
        job :func:`auditable` refuses, a grammar this machine cannot build, or a prompt +
        answer longer than the context."""
        if not auditable(job):
            raise Unauditable("only chat and completion jobs are audited")
        params = job.get("params") or {}
        whole = self._prompt.tokens(job)
        prompt, healer = healing(job, whole, self.vocab) if job.get("rewrite") or resumes_text(job) else (whole, None)
        rewritten = healer.dropped if healer is not None else b""
        reason = self._spelling(job, whole, token_ids, text, finish_reason, rewritten=rewritten)
        if reason:
            return Audit(reason=reason)
        if len(prompt) + len(token_ids) - 1 > self.n_ctx:
            raise Unauditable(f"{len(prompt)} + {len(token_ids)} tokens do not fit in {self.n_ctx}")
        checked = self._fresh(token_ids, rewritten)
        if sample is not None and sample < len(checked):
            checked = set(random.SystemRandom().sample(sorted(checked), max(sample, 0)))
        constraint = _Constraint(self._llm, self._grammar(params.get("response_format")), healer)
        try:
            answer = _Answer(token_ids, seed, _sampling(params, "temperature"), _sampling(params, "top_p"), constraint)
            if logprobs is not None and params.get("logprobs") is not None:
                answer.entries = self._entries(
                    token_ids, logprobs, skip=len(rewritten.decode("utf-8", errors="ignore")), delivered=len(text)
                )
                answer.last_own = bool(
                    self._lib.llama_vocab_is_eog(self._lib.llama_model_get_vocab(self._llm.model), token_ids[-1])
                )
            return self._judged(prompt, answer, checked)
        finally:
            constraint.close()

    def _judged(self, prompt: list[int], answer: _Answer, checked: set[int]) -> Audit:
        """The replay, a second look at what it missed, and the verdict."""
        far: dict[int, float] = {}
        audit = self._replay(prompt, answer, checked, far)
        if audit.reason:  # a token the host could not have drawn: no second look clears it
            return audit
        if audit.misses or far:
            self._second_look(prompt, answer, audit, far)
        if audit.misses:
            index, token, margin = audit.misses[0]
            audit.reason = (
                f"{len(audit.misses)} of {audit.checked} tokens are not what the seeded draw selects "
                f"(the first at token {index}, id {token}, by {margin:.3g})"
            )
        elif far:
            index, gap = min(far.items())
            audit.reason = (
                f"{len(far)} reported log-probabilities are not the model's (the first at token {index}, "
                f"off by {gap:.3g}, more than {self.logprob_tolerance:g})"
            )
        return audit

    def _grammar(self, response_format: dict | None) -> object | None:
        """The host's grammar for ``response_format`` (None: free text), converted behind the
        fence unless this process may not start its child (a Celery prefork worker is
        daemonic: multiprocessing refuses it children): the gateway's own fence converted the
        schema already when it took the request, so it is known to convert, and in bounds."""
        import multiprocessing

        try:
            return grammar_for(response_format, fenced=not multiprocessing.current_process().daemon)
        except (RequestRejected, FenceUnavailable) as cannot:
            raise Unauditable(f"the response_format's grammar cannot be built here: {cannot}") from cannot

    def _fresh(self, token_ids: list[int], rewritten: bytes) -> set[int]:
        """The indices of the tokens that end at or past the end of the re-written text: the
        newly generated part (all of them when nothing is re-written)."""
        if not rewritten:
            return set(range(len(token_ids)))
        written = 0
        for index, token in enumerate(token_ids):
            written += len(self.vocab.pieces[token])
            if written >= len(rewritten):
                return set(range(index, len(token_ids)))
        return set()

    def _entries(self, token_ids: list[int], logprobs: list[dict], *, skip: int, delivered: int) -> dict[int, dict]:
        """The reported entries by the index of the token each is for: as the host's aligner
        (:class:`~mahout.runners.logprobs.TokenAligner`) hands them out, one for each token
        whose characters reach past the ``skip`` re-written ones and start before the end of
        the ``delivered`` ones."""
        import codecs

        decoder, at, indices = codecs.getincrementaldecoder("utf-8")(errors="replace"), 0, []
        for index, token in enumerate(token_ids):
            end = at + len(decoder.decode(self.vocab.pieces[token]))
            if end > skip and at < skip + delivered:
                indices.append(index)
            at = end
        return dict(zip(indices, logprobs, strict=False))

    def _spelling(
        self,
        job: dict,
        prompt: list[int],
        token_ids: list[int],
        text: str,
        finish_reason: str,
        *,
        rewritten: bytes = b"",
    ) -> str | None:
        """Why ``token_ids`` are not the answer delivered as ``text`` with ``finish_reason`` (None: they are).

        As llama.cpp ends an answer: the ids spell the ``rewritten`` text (a healed word, a
        rewrite) then the delivered text (as bytes); no token before the last completes a stop
        string; "stop" ends in one end-of-generation token, or in the token that completes a
        stop string (the text ends where that stop string starts); "length" means the host's
        budget of tokens (``max_tokens``, more for a rewrite; or a full context). An
        unfinished character at the end may be held back from the text. ``prompt``: the
        job's prompt before healing (the host's budget is counted from it)."""
        if not token_ids:
            return "no token ids were reported"
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.n_vocab for t in token_ids):
            return "a reported token id is not in the model's vocabulary"
        vocab = self._lib.llama_model_get_vocab(self._llm.model)
        if any(self._lib.llama_vocab_is_eog(vocab, t) for t in token_ids[:-1]):
            return "tokens continue past an end of generation"
        ended = bool(self._lib.llama_vocab_is_eog(vocab, token_ids[-1]))
        sampled = token_ids[:-1] if ended else token_ids
        asked = int((job.get("params") or {}).get("max_tokens") or self.n_ctx)
        max_tokens = rewrite_budget(job, asked, lambda rewrite: count_tokens(self._llm, rewrite))
        if len(sampled) > max_tokens and len(sampled) > _length_end(self._llm.detokenize, sampled, max_tokens):
            return f"{len(sampled)} tokens where max_tokens is {asked}"
        spelled, delivered = _as_streamed(self._llm.detokenize(sampled)), rewritten + text.encode("utf-8")
        if not spelled.startswith(delivered):  # llama-cpp-python's stream drops more after a byte that is no UTF-8
            spelled = _llama_streamed([self.vocab.pieces[token] for token in sampled])
        if not spelled.startswith(delivered):
            return (
                "the token ids do not spell the delivered text"
                if spelled.startswith(rewritten)
                else "the token ids do not write again the text the job resumes"
            )
        rest = spelled[len(delivered) :]
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
        if finish_reason == "length" and (
            ended or (len(sampled) < max_tokens and len(prompt) + len(sampled) < self.n_ctx)
        ):
            return f"'length' after {len(sampled)} of {max_tokens} tokens" + (
                " and an end of generation" if ended else ""
            )
        if finish_reason not in ("stop", "length"):
            return f"unknown finish reason {finish_reason!r}"
        return None

    def _replay(self, prompt: list[int], answer: _Answer, checked: set[int], far: dict[int, float]) -> Audit:
        """One prefill pass over prompt + answer, as far as the last token of ``checked``
        (indices) and no further, checking each at the position that predicts it as soon as
        that position's logits are computed (llama.cpp computes logits only there); the
        constraint is fed every token in order, those past the last checked one too. Reported
        log-probabilities further off than the tolerance go in ``far``."""
        import numpy as np

        lib, ctx, batch = self._lib, self._llm.ctx, self._batch
        lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
        tokens = answer.tokens
        # up to the position that predicts the last checked token: nothing after it is read
        sequence = prompt + tokens[: max(checked)] if checked else []
        first = len(prompt) - 1  # the position whose logits predict tokens[0]
        audit = Audit()
        for start in range(0, len(sequence), self.n_batch):
            chunk = sequence[start : start + self.n_batch]
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
                refused = answer.constraint.refusal(tokens[index])
                if refused:
                    audit.misses.append((index, tokens[index], float("inf")))
                    audit.reason = f"token {index} (id {tokens[index]}) {refused}"
                    return audit
                if index in checked:
                    logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, i), shape=(self.n_vocab,))
                    audit.checked += 1
                    self._judge(audit, audit.misses, far, logits, answer, index, position)
                answer.constraint.advance(tokens[index])
        for index in range(len(sequence) + 1 - len(prompt) if checked else 0, len(tokens)):  # past the last checked
            refused = answer.constraint.refusal(tokens[index])
            if refused:
                audit.misses.append((index, tokens[index], float("inf")))
                audit.reason = f"token {index} (id {tokens[index]}) {refused}"
                return audit
            answer.constraint.advance(tokens[index])
        return audit

    def _judge(
        self,
        audit: Audit,
        misses: list[tuple[int, int, float]] | None,
        far: dict[int, float] | None,
        logits: npt.NDArray[np.float32],
        answer: _Answer,
        index: int,
        position: int,
    ) -> None:
        """Check answer token ``index`` (drawn at ``position``) against ``logits``: a match or an
        uncertain token is counted on ``audit``, a miss appended to ``misses`` (``misses`` None:
        the token is not judged again). Its reported log-probabilities, if any, are compared
        too (``far`` None: they are not), one too far off recorded in ``far``."""
        import numpy as np

        scores = np.array(logits, dtype=np.float32)  # (n_vocab,) a copy: llama.cpp reuses its buffer
        token = answer.tokens[index]
        if far is not None and index in answer.entries:
            gap = _logprob_gap(
                scores, answer.entries[index], token if answer.last_own or index < len(answer.tokens) - 1 else None
            )
            if gap > self.logprob_tolerance:
                far[index] = gap
            else:
                far.pop(index, None)
        if misses is None:
            return
        scores = answer.constraint.masked(scores)
        sampling = {"temperature": answer.temperature, "top_p": answer.top_p, "u": uniform(answer.seed, position)}
        grammar = answer.constraint.grammar
        if grammar is not None:
            if select_masked(scores, grammar.allowed, **sampling) == token:  # the usual case, asking the grammar little
                audit.matched += 1
                return
            scores = np.where(grammar.allowed(np.arange(len(scores))), scores, np.float32(-np.inf))
        check = token_check(scores, token, tolerance=self.tolerance, tie_gap=self.tie_gap, **sampling)
        if check.verdict == MATCH:
            audit.matched += 1
        elif check.verdict == MISS:
            misses.append((index, token, check.margin))
        else:
            audit.uncertain += 1

    def _second_look(self, prompt: list[int], answer: _Answer, audit: Audit, far: dict[int, float]) -> None:
        """Check the prefill's misses (and reported log-probabilities it found too far off) again
        with logits computed as a host computes them: the prompt prefilled alone, then the answer
        decoded one token at a time. On some CPUs llama.cpp's batched kernels differ from its
        one-token kernels by about a logit (0.8 median on an AVX-512/AMX Xeon), far more than
        ``tie_gap`` allows, and a prompt's rows computed in a batch with the answer differ from
        its rows computed alone. Only answers with a miss pay for this; a token missed here too
        stays a miss, and a value off here too stays off."""
        import numpy as np

        lib, ctx, batch = self._lib, self._llm.ctx, self._batch
        missed = {index for index, _, _ in audit.misses}
        looked = missed | set(far)
        lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
        answer.constraint.restart()
        kept: list[tuple[int, int, float]] = []
        sequence = prompt + answer.tokens[: max(looked)]
        start = 0
        while start < len(sequence):
            # the prompt in n_batch chunks, as llama-cpp-python evaluates it; then one token at a time
            size = min(self.n_batch, len(prompt) - start) if start < len(prompt) else 1
            begin, chunk = start, sequence[start : start + size]
            start += len(chunk)
            batch.n_tokens = len(chunk)
            for i, token in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = (
                    token,
                    begin + i,
                    1,
                    i == len(chunk) - 1,
                )
                batch.seq_id[i][0] = 0
            if lib.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed during an audit")
            position = start  # of the token the last row's logits predict
            index = position - len(prompt)
            if index < 0:
                continue
            if index in looked:
                logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, len(chunk) - 1), shape=(self.n_vocab,))
                self._judge(
                    audit,
                    kept if index in missed else None,
                    far if index in far else None,
                    logits,
                    answer,
                    index,
                    position,
                )
            answer.constraint.advance(answer.tokens[index])
        audit.misses = kept


def _logprob_gap(logits: npt.NDArray[np.float32], entry: dict, token: int | None) -> float:
    """How far a reported entry is from the log-softmax of ``logits``, in nats: its token's own
    value (``token`` None: not compared, the host named the token from its text) and its
    alternatives' values, best first (infinite for an entry that is not numbers)."""
    import numpy as np

    shifted = logits - logits.max()
    logprobs = shifted - np.log(np.sum(np.exp(shifted, dtype=np.float64)))  # as the host's recorder computes them
    try:
        alternatives = [float(top["logprob"]) for top in entry.get("top_logprobs") or []]
        reported = ([float(entry["logprob"])] if token is not None else []) + alternatives
    except (TypeError, KeyError, ValueError, AttributeError):
        return float("inf")
    if len(alternatives) >= len(logprobs):
        return float("inf")
    best = np.sort(np.partition(-logprobs, len(alternatives))[: len(alternatives)]) if alternatives else np.array([])
    expected = ([float(logprobs[token])] if token is not None else []) + [-float(v) for v in best]
    gaps = [abs(max(r, LOGPROB_FLOOR) - max(e, LOGPROB_FLOOR)) for r, e in zip(reported, expected, strict=True)]
    return max(gaps, default=0.0) if all(np.isfinite(gaps)) else float("inf")


def _length_end(detokenize: Callable[[list[int]], bytes], tokens: list[int], max_tokens: int) -> int:
    """How many of ``tokens`` llama.cpp's stream generates before ``max_tokens`` stops it. It
    skips that check (and every other) while the text's last three bytes hold what it takes for
    the start of an unfinished character, and for as many tokens as that character seemed to
    lack, so a character split over the budget's last token is finished first: up to three
    tokens past ``max_tokens``. Its rule, replayed from a few tokens before the budget (what it
    carries over lasts three tokens at most)."""
    skip = 0
    for n in range(max(1, max_tokens - 4), len(tokens) + 1):
        skip = _unfinished(detokenize(tokens[:n]), skip)
        if skip > 0:
            skip -= 1
            continue
        if n >= max_tokens:
            return n
    return max(len(tokens), max_tokens)


def _unfinished(text: bytes, carried: int) -> int:
    """llama-cpp-python's count of tokens to wait while ``text`` may end in an unfinished
    character (``carried``: the count before this token): a lead byte among its last three
    bytes sets it to the bytes that character still lacks; otherwise it is kept."""
    for index, byte in enumerate(text[-3:]):
        for size, lead in ((2, 0xC0), (3, 0xE0), (4, 0xF0)):
            if size > 3 - index and byte & lead == lead:
                carried = size - (3 - index)
    return carried


def _as_streamed(spelled: bytes) -> bytes:
    """``spelled`` as a host's stream delivers it: bytes that are not UTF-8 (a lone byte token
    drawn at a high temperature) are dropped, as llama.cpp's streams decode (``errors="ignore"``),
    and an unfinished character at the end is kept, for `_held_back` to judge. Dropping them
    adds no text, so an answer cannot differ from its tokens by more than bytes no one reads."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")
    readable = decoder.decode(spelled, final=False)
    pending, _ = decoder.getstate()
    return readable.encode("utf-8") + pending


def _llama_streamed(pieces: list[bytes]) -> bytes:
    """The text llama-cpp-python's completion stream yields (no log-probabilities asked, no stop
    string met) for tokens that write ``pieces``, its rule replayed. After each token it yields
    the shortest run of pending tokens that decodes as UTF-8, strictly, as long as one does;
    after a byte that is no UTF-8 none ever does again, so the rest waits for the end, when
    each pending token is decoded on its own, dropping what is not UTF-8 in it: a character
    split over two of those tokens is dropped whole. While the text's last bytes look like
    the start of an unfinished character it yields nothing (`_length_end` replays the same)."""
    out, written, returned, fix = b"", b"", 0, 0
    for n in range(1, len(pieces) + 1):
        written += pieces[n - 1]
        fix = _unfinished(written, fix)
        if fix > 0:
            fix -= 1
            continue
        while returned < n:
            for count in range(1, n - returned + 1):
                chunk = b"".join(pieces[returned : returned + count])
                try:
                    chunk.decode("utf-8")
                except UnicodeDecodeError:
                    continue
                out, returned = out + chunk, returned + count
                break
            else:
                break
    return out + b"".join(piece.decode("utf-8", errors="ignore").encode("utf-8") for piece in pieces[returned:])


def _held_back(rest: bytes) -> bool:
    """True when ``rest`` is nothing, or only the start of a character a stream holds back."""
    return len(rest) <= INCOMPLETE_UTF8_MAX and rest.decode("utf-8", errors="ignore") == ""
