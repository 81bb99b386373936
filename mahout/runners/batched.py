"""llama.cpp runner for several jobs at once: one model load, S sequences, one step loop.

Decoding is bound by reading the weights: one ``llama_decode`` that advances S sequences costs
little more than one that advances a single sequence. :class:`BatchedLlamaRunner` keeps, beside
the single-sequence ``Llama`` that tokenizes, heals and scores (``runner._llm``, untouched), one
more llama.cpp context on the same model with ``n_seq_max = S``. Each sequence has its own KV
stream of ``n_ctx`` cells (``kv_unified`` off). In a unified cache a sequence's cells lie among
the others' and its logits moved 0.3 to 0.4 from a lone sequence's; in its own stream they are
the same bit for bit. A unified cache would read a prompt piece in the same pass as the running
tokens (measured 61 to 71 ms a step of 3 decoding sequences and 16 prompt tokens, against 78 to
80), which is not worth a host's answers differing from LlamaRunner's.

A step thread runs the loop (:meth:`BatchedLlamaRunner._step`): one ``llama_decode`` advances
every running sequence by a token, and prompts are read beside them a piece at a time (chunked
prefill); each sequence's logits then pass through its own job's processors (the same classes as
``LlamaRunner``: log-probability recorder, healer, specified or grammar sampler), the one token
left finite is taken, and its text is cut exactly as ``create_completion(stream=True)`` cuts it
(:class:`CompletionText`) before it goes to the job's own queue. ``stream(job)`` is called from
one thread per job and returns a :class:`JobStream` reading that queue. The model's weights are
loaded unpacked (:func:`weights_unpacked`), so a decoded token's logits do not depend on the
sequences beside it: a job gets the tokens it gets from LlamaRunner alone (see the tests for
where a prompt read in pieces makes the exception).

Prompts are shared: a job whose prompt starts with enough tokens some sequence holds in its KV
(a running one, or a finished one still held) copies them (``llama_memory_seq_cp``) and reads
only the rest; a job whose prompt another sequence is still reading waits for it. The ``n``
choices of one request are such jobs: each after the first starts from the first's prompt, and
from the logits kept at its end, reading no token at all. A finished sequence is held at most
``prompt_cache_seconds`` (PROMPT_CACHE_SECONDS) after it last served a job, then its KV is
cleared: a customer's prompt is not kept in a host's memory past the bound the gateway promises.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mahout.runners import Piece, job_number, job_seed
from mahout.runners.llama import ContextOverflowError, GrammarSampler, LlamaRunner, SpecifiedSampler
from mahout.runners.logprobs import LogprobRecorder, TokenAligner
from protocol.timing import PROMPT_CACHE_SECONDS
from scorer.healing import TokenHealer, rewrite_budget
from scorer.llama import Grammar, count_tokens, grammar_for

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    Processor = Callable[[npt.NDArray[np.intc], npt.NDArray[np.single]], npt.NDArray[np.single]]

# How prompts are read beside running sequences (with none running, a prompt is read n_batch
# tokens at a time, as LlamaRunner reads it). A piece costs a pass over the weights of its own
# (llama.cpp cuts a batch of several KV streams into passes of equal tokens per sequence) plus its
# tokens. Measured on the shipped model, 2 threads, 3 streams beside a 2,000-token prompt read in
# pieces: their inter-token p99 went to 1.8 to 2.4 times idle with pieces of 16 tokens, 1.8 to 2.2
# with 8, 2.4 with 32; with 16 that prompt's first token came 11.4 s after it arrived (5.1 s
# with nothing running). A short prompt is read whole, in one step (its first token comes at
# once, and its logits are exactly LlamaRunner's; see `_step`); a longer one PREFILL_CHUNK_TOKENS
# a step, so it never holds the running streams for more than one chunk.
PREFILL_CHUNK_TOKENS = 16
WHOLE_PROMPT_TOKENS = 64  # prompt tokens read in all in one step beside running sequences
IDLE_WAIT_SECONDS = 0.5  # how long the step thread sleeps with nothing to do (held sequences expire meanwhile)
_END = object()  # a job's queue: generation over, the stream's attributes hold


_LOADING = threading.Lock()


@contextlib.contextmanager
def weights_unpacked() -> Iterator[None]:
    """Models loaded inside keep ggml's plain weight layout (``use_extra_bufts`` off). The
    layout ggml repacks weights into for this CPU multiplies rows in groups of four by one
    kernel and the rest by another, so a sequence's logits would depend on where it sits in the
    batch: 0.43 of a logit apart on the shipped model, enough to flip a greedy token. Unpacked,
    every row is computed alike: a decoded token's logits are bit for bit the same beside 0 to 7
    other sequences, so a job's tokens are the ones it gets alone. Measured no slower here
    (decode of 1, 4 and 8 sequences, prefill). llama-cpp-python takes the setting only from its
    default model params, which are swapped for the load (a model another thread loads
    meanwhile is unpacked too: harmless)."""
    import llama_cpp

    with _LOADING:
        original = llama_cpp.llama_cpp.llama_model_default_params

        def unpacked() -> llama_cpp.llama_model_params:
            defaults = original()
            defaults.use_extra_bufts = False
            return defaults

        llama_cpp.llama_cpp.llama_model_default_params = unpacked
        try:
            yield
        finally:
            llama_cpp.llama_cpp.llama_model_default_params = original


class CompletionText:
    """The text ``Llama.create_completion(stream=True)`` (llama-cpp-python 0.3) streams for the
    tokens it samples, fed one sampled token at a time: the same chunks, in the same order, the
    same finish. An end of generation stops it unseen; otherwise text that could begin a stop
    string, or that ends in an unfinished UTF-8 character, is held back until known; a stop
    string cuts the text before it; ``max_tokens`` tokens end it with "length". Its quirks are
    kept, since a host's answer must be the one the single runner gives: a token that ends in
    the lead byte of a multi-byte character skips the checks of the next ones (``max_tokens``
    included), and the last chunk is always "" (what carries ``finish_reason`` there)."""

    def __init__(
        self,
        *,
        spell: Callable[[list[int]], bytes],
        ends: Callable[[int], bool],
        stop: list[str],
        max_tokens: int,
    ) -> None:
        self._spell, self._ends = spell, ends
        self._stops = [text.encode("utf-8") for text in stop]
        self.max_tokens = max_tokens
        self.tokens: list[int] = []  # generated, an end of generation excluded
        self._returned = 0  # tokens whose text was streamed
        self._multibyte = 0  # tokens still to take before the text is checked again
        self.finish_reason: str | None = None  # "stop" | "length" once over

    def push(self, token: int) -> list[str]:
        """The chunks streamed once ``token`` is sampled (all the rest when it ends the text)."""
        if self._ends(token):
            return self.finish("stop")
        self.tokens.append(token)
        text = self._spell(self.tokens)
        for index, byte in enumerate(text[-3:]):
            back = 3 - index  # (as llama-cpp-python counts it, also when the text is shorter)
            for length, lead in ((2, 192), (3, 224), (4, 240)):
                if length > back and lead & byte == lead:
                    self._multibyte = length - back
        if self._multibyte > 0:
            self._multibyte -= 1
            return []
        if any(stop in text for stop in self._stops):
            return self.finish("stop")
        chunks = self._released()
        if len(self.tokens) >= self.max_tokens:
            return chunks + self.finish("length")
        return chunks

    def _released(self) -> list[str]:
        """Whole characters not yet streamed, less a tail that may begin a stop string."""
        remaining = self.tokens[self._returned :]
        text = self._spell(remaining)
        held = 0
        for stop in self._stops:
            for size in range(min(len(stop), len(text)), 0, -1):
                if text.endswith(stop[:size]):
                    held = max(held, size)
                    break
        chunks, end = [], 0
        while remaining:
            for count in range(1, len(remaining) + 1):
                spelled = self._spell(remaining[:count])
                try:
                    chunk = spelled.decode("utf-8")
                    break
                except UnicodeError:
                    pass
            else:
                break
            end += len(spelled)
            if end > len(text) - held:
                break
            remaining = remaining[count:]
            self._returned += count
            chunks.append(chunk)
        return chunks

    def finish(self, reason: str) -> list[str]:
        """The rest of the text, cut before the first stop string in it, then the last ""."""
        remaining = self.tokens[self._returned :]
        text = self._spell(remaining)
        found = [text.index(stop) for stop in self._stops if stop in text]
        end = min(found) if found else len(text)
        chunks, position = [], 0
        for token in remaining:
            piece = self._spell([token])
            position += len(piece)
            self._returned += 1
            if position >= end:
                chunks.append(piece[: len(piece) - (position - end)].decode("utf-8", errors="ignore"))
                break
            chunks.append(piece.decode("utf-8", errors="ignore"))
        self.finish_reason = reason
        return [*chunks, ""]


@dataclass(eq=False)
class _Job:
    """One job between :meth:`BatchedLlamaRunner._plan` and its end: what LlamaRunner.stream
    builds for create_completion, and what it delivers, per job."""

    prompt: list[int]  # the tokens fed (a healed prompt lacks its cut word)
    prompt_count: int  # the rendered prompt's tokens (before healing), as LlamaRunner counts them
    seed: int
    max_tokens: int  # what create_completion was given
    rewrite: bool
    processors: list[Processor]
    sampler: SpecifiedSampler | GrammarSampler
    text: CompletionText
    healer: TokenHealer | None
    aligner: TokenAligner | None
    matcher: Grammar | None
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    pieces: list[str] = field(default_factory=list)  # the text delivered
    read: int = 0  # the prompt's tokens read (prefilled) once seated; the rest came from a held sequence's KV
    cache_key: str = ""  # the job's account on this host (`JobPayload.cache_key`): KV is shared within one key only

    def choose(self, input_ids: npt.NDArray[np.intc], scores: npt.NDArray[np.single]) -> int:
        """The job's processors over one position's logits, in LlamaRunner's order; the token
        llama.cpp's greedy sampler then takes (the one left finite)."""
        import numpy as np

        for processor in self.processors:
            scores = processor(input_ids, scores)
        return int(np.argmax(scores))

    def deliver(self, chunks: list[str]) -> None:
        """Hand chunks of create_completion's text to the consumer as LlamaRunner.stream does."""
        for chunk in chunks:
            if self.aligner is not None:
                self._put(*self.aligner.feed(chunk))
            else:
                self._put(self.healer.strip(chunk) if self.healer else chunk, None)
        if self.text.finish_reason is not None and self.aligner is not None:
            self._put(*self.aligner.finish())

    def _put(self, text: str, entries: list[dict] | None) -> None:
        if entries is not None and (text or entries):
            self.pieces.append(text)
            self.out.put(Piece(text, entries))
        elif entries is None and text:
            self.pieces.append(text)
            self.out.put(text)

    def end(self, error: BaseException | None = None) -> None:
        """Release the grammar and tell the consumer the job is over (or why it failed)."""
        if self.matcher is not None:
            self.matcher.close()
            self.matcher = None
        self.out.put(error if error is not None else _END)


class JobStream(Iterator[str]):
    """One job's text, as LlamaRunner.stream yields it (str, or :class:`Piece` with
    log-probabilities). The job is planned on the first ``next`` (in the caller's thread, so
    RequestRejected and its kin surface from the iterator as they do from the generator), then
    read from its queue. Once exhausted, ``finish_reason``, ``completion_tokens``, ``token_ids``,
    ``seed``, ``prompt_count`` and ``prompt_read`` (the prompt's tokens read, not copied from a held
    sequence) hold. ``close()`` before the end cancels: the sequence is freed."""

    def __init__(self, runner: BatchedLlamaRunner, job: dict) -> None:
        self._runner, self._job = runner, job
        self._planned: _Job | None = None
        self._over = False
        self.finish_reason = "stop"
        self.completion_tokens = 0
        self.token_ids: list[int] = []
        self.seed: int | None = None
        self.prompt_count = 0
        self.prompt_read = 0

    def __next__(self) -> str:
        if self._over:
            raise StopIteration
        if self._planned is None:
            try:
                self._planned = self._runner._plan(self._job)
                self._runner._submit(self._planned)
            except BaseException:
                self._over = True
                if self._planned is not None:
                    self._planned.end()  # (a job the runner refused: its grammar's sampler freed)
                raise
            self.token_ids, self.seed, self.prompt_count = (
                self._planned.sampler.token_ids,
                self._planned.seed,
                self._planned.prompt_count,
            )
        item = self._planned.out.get()
        if isinstance(item, str):
            return item
        self._over = True
        if isinstance(item, BaseException):
            raise item
        planned = self._planned
        self.finish_reason = planned.text.finish_reason or "stop"
        self.prompt_read = planned.read
        self.completion_tokens = (
            planned.max_tokens
            if self.finish_reason == "length" and not planned.rewrite
            else count_tokens(self._runner._llm, "".join(planned.pieces))
        )
        raise StopIteration

    def close(self) -> None:
        """Cancel the job if it is still running (its sequence is freed at the next step)."""
        if self._planned is not None and not self._over:
            self._runner._cancel(self._planned)
        self._over = True


@dataclass(eq=False)
class _Slot:
    """One of the context's S sequences: its KV holds ``tokens[:n_past]``."""

    seq: int
    job: _Job | None = None
    tokens: list[int] = field(default_factory=list)  # the prompt, then each token sampled
    n_past: int = 0
    prompt_len: int = 0
    prompt_logits: npt.NDArray[np.single] | None = None  # the logits at the prompt's end, kept for a job that shares it
    start_logits: npt.NDArray[np.single] | None = None  # a job starting from them: sampled without a decode
    used: int = 0  # the step it last served a job (a held sequence unused longest is given up first)
    used_at: float = 0.0  # time.monotonic() when it last served a job (a held sequence expires after the bound)
    cache_key: str = ""  # the key of the job it last served: only a job with the same key starts from its KV

    def pending(self) -> list[int]:
        return self.tokens[self.n_past :]

    def prefix(self, prompt: list[int], *, upcoming: bool = False) -> int:
        """Tokens ``prompt`` shares with this sequence's KV (``upcoming``: with the prompt it is reading)."""
        held = self.tokens[: self.prompt_len] if upcoming else self.tokens[: self.n_past]
        count = 0
        for mine, theirs in zip(held, prompt, strict=False):
            if mine != theirs:
                break
            count += 1
        return count


class BatchedLlamaRunner(LlamaRunner):
    """LlamaRunner's jobs, S at once from one model load (see the module's docstring).
    ``prefilled_tokens`` counts the prompt tokens decoded, for measuring what sharing saves.
    A finished sequence's KV is held ``prompt_cache_seconds`` after it last served a job."""

    def __init__(
        self,
        model_path: str | Path,
        threads: int,
        n_ctx: int = 4096,
        gpu_layers: int = 0,
        slots: int = 4,
        *,
        chunk: int = PREFILL_CHUNK_TOKENS,
        whole: int = WHOLE_PROMPT_TOKENS,
        prompt_cache_seconds: float = PROMPT_CACHE_SECONDS,
    ) -> None:
        import llama_cpp

        with weights_unpacked():
            super().__init__(
                model_path, threads, n_ctx=n_ctx, gpu_layers=gpu_layers, prompt_cache_seconds=prompt_cache_seconds
            )
        self.slots, self.chunk, self.whole = slots, chunk, whole
        self.prefilled_tokens = 0
        params = llama_cpp.llama_context_default_params()
        ctypes.pointer(params)[0] = self._llm.context_params  # the single context's settings...
        # ...and S streams of n_ctx cells (llama.cpp pads a context to 256 cells, then divides it among the streams)
        params.n_ctx, params.n_seq_max, params.kv_unified = -(-n_ctx // 256) * 256 * slots, slots, False
        self._ctx = llama_cpp.llama_init_from_model(self._llm.model, params)
        if not self._ctx or llama_cpp.llama_n_ctx_seq(self._ctx) < n_ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {slots} sequences of {n_ctx} tokens")
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self._n_batch = llama_cpp.llama_n_batch(self._ctx)
        self._batch = llama_cpp.llama_batch_init(self._n_batch, 0, 1)
        self._n_vocab = self._llm.n_vocab()
        self._vocab_handle = llama_cpp.llama_model_get_vocab(self._llm.model)
        self._pieces: dict[int, bytes] = {}
        self._slots = [_Slot(seq) for seq in range(slots)]
        self._waiting: list[_Job] = []  # submitted, not yet given a sequence (in order)
        self._cancelled: set[_Job] = set()
        self._steps = 0
        self._closing = False
        self.broken = False  # its step loop failed: every job it had failed, and it takes none (see HostLoop._run)
        self._wake = threading.Condition()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="mahout-draw")
        self._loop = threading.Thread(target=self._run, name="mahout-batch", daemon=True)
        self._loop.start()

    # --- the consumer's side -------------------------------------------------------------

    def stream(self, job: dict) -> JobStream:  # type: ignore[override]
        """The job's text as an iterator (see :class:`JobStream`); safe from several threads at once."""
        return JobStream(self, job)

    def close(self) -> None:
        """Stop the step thread (jobs still open fail), free the context, then the model."""
        import llama_cpp

        with self._wake:
            self._closing = True
            self._wake.notify()
        self._loop.join()
        self._pool.shutdown()
        llama_cpp.llama_batch_free(self._batch)
        llama_cpp.llama_free(self._ctx)
        super().close()

    def _plan(self, job: dict) -> _Job:
        """What LlamaRunner.stream sets up before create_completion, for one job."""
        params = job.get("params") or {}
        tokens = self._prompt.tokens(job)
        prompt_count = len(tokens)
        if prompt_count >= self.n_ctx:
            raise ContextOverflowError(f"prompt is {prompt_count} tokens; the context window is {self.n_ctx} tokens")
        budget = self.n_ctx - prompt_count
        max_tokens = min(int(params.get("max_tokens") or budget), budget)
        grammar = grammar_for(params.get("response_format"))
        rewrite = job.get("rewrite") or ""
        max_tokens = min(rewrite_budget(job, max_tokens, lambda text: count_tokens(self._llm, text)), budget)
        tokens, healer = self._healing(job, tokens)
        temperature, top_p = job_number(params, "temperature", 1.0), job_number(params, "top_p", 1.0)
        seed = job_seed(params)
        recorder = aligner = None
        if params.get("logprobs") is not None:
            self._vocab_ready.join()
            assert self._vocab is not None
            recorder = LogprobRecorder(prompt_len=len(tokens), top=int(params["logprobs"]))
            aligner = TokenAligner(recorder, self._vocab.pieces, skip=len(healer.pending) if healer else 0)
        processors: list[Processor] = [recorder] if recorder else []
        processors += list(healer.processors()) if healer else []
        matcher = Grammar(self._llm, grammar) if grammar is not None else None
        sampler: SpecifiedSampler | GrammarSampler = (
            GrammarSampler(matcher, prompt_len=len(tokens), seed=seed, temperature=temperature, top_p=top_p)
            if matcher is not None
            else SpecifiedSampler(seed=seed, temperature=temperature, top_p=top_p)
        )
        processors.append(sampler)
        # create_completion's own clamp, over the tokens fed
        max_tokens = max_tokens if max_tokens + len(tokens) < self.n_ctx else self.n_ctx - len(tokens)
        text = CompletionText(spell=self._spell, ends=self._ends, stop=self.stop_strings(job), max_tokens=max_tokens)
        return _Job(
            prompt=tokens,
            prompt_count=prompt_count,
            seed=seed,
            max_tokens=max_tokens,
            rewrite=bool(rewrite),
            processors=processors,
            sampler=sampler,
            text=text,
            healer=healer,
            aligner=aligner,
            matcher=matcher,
            cache_key=str(job.get("cache_key") or ""),
        )

    def _submit(self, job: _Job) -> None:
        with self._wake:
            if self._closing:
                raise RuntimeError("the batched runner is closed")
            self._waiting.append(job)
            self._wake.notify()

    def _cancel(self, job: _Job) -> None:
        with self._wake:
            self._cancelled.add(job)
            self._wake.notify()

    def _spell(self, tokens: list[int]) -> bytes:
        """Llama.detokenize of ``tokens`` (pieces cached; a space after a leading BOS dropped, as it drops it)."""
        pieces = self._pieces
        for token in tokens:
            if token not in pieces:
                pieces[token] = self._llm.detokenize([token])
        text = b"".join(pieces[token] for token in tokens)
        return text[1:] if tokens and tokens[0] == self._llm.token_bos() and text[:1] == b" " else text

    def _ends(self, token: int) -> bool:
        import llama_cpp

        return bool(llama_cpp.llama_vocab_is_eog(self._vocab_handle, token))

    # --- the step thread -----------------------------------------------------------------

    def _run(self) -> None:
        """Step until closed; a failure of the loop itself fails every open job with it."""
        try:
            while True:
                with self._wake:
                    if self._closing:
                        break
                    cancelled, self._cancelled = self._cancelled, set()
                for job in cancelled:
                    self._drop(job)
                with self._wake:
                    arrived = list(self._waiting)
                self._expire_held()
                if not self._step(arrived):
                    with self._wake:
                        if not self._closing and not self._cancelled and len(self._waiting) == len(arrived):
                            self._wake.wait(IDLE_WAIT_SECONDS)
            error: BaseException = RuntimeError("the batched runner was closed while the job ran")
        except BaseException as exc:  # noqa: BLE001 (handed to every consumer, who raises it)
            error = exc
        with self._wake:
            self.broken = not self._closing  # the loop failed (not closed): the host unloads it and loads it again
            self._closing = True
            open_jobs = [slot.job for slot in self._slots if slot.job] + self._waiting
            self._waiting = []
        for job in open_jobs:
            job.end(error)

    def _step(self, arrived: list[_Job]) -> bool:
        """Seat arrived jobs; sample the sequences that start from kept logits; read prompts, each
        piece in a decode of its own: with no sequence running, n_batch tokens of each (as
        LlamaRunner reads them); beside running ones, up to WHOLE_PROMPT_TOKENS in all, each prompt
        whose rest fits read whole and at most one other's next PREFILL_CHUNK_TOKENS; then advance
        every running sequence by one token in one decode. Prompts first: a job arriving while
        others run waits for its first token only for the step under way. False when there was
        nothing to do.

        A piece of a prompt gets a decode of its own because llama.cpp's logits depend on how a
        prompt is cut into passes (up to about one logit on the shipped model), while a decoded
        token's do not depend on the sequences beside it: so a prompt read in one piece gives
        exactly LlamaRunner's logits, and llama.cpp would split a mixed batch in two passes anyway."""
        self._steps += 1
        for job in arrived:
            self._seat(job)
        active = [slot for slot in self._slots if slot.job]
        ready = [(slot, slot.start_logits) for slot in active if slot.start_logits is not None]
        running = [slot for slot in active if slot.start_logits is None and slot.n_past >= slot.prompt_len]
        reading = sorted((slot for slot in active if slot.n_past < slot.prompt_len), key=lambda slot: slot.used)
        for slot, _ in ready:
            slot.start_logits = None
        self._sample(ready)
        for slot, piece in self._pieces_to_read(reading, beside_running=bool(running)):
            self.prefilled_tokens += len(piece)
            read = self._decode([(slot, piece)])
            for done, logits in read:
                done.prompt_logits = logits.copy()  # kept for a job with the same prompt
            self._sample(read)
        if running:
            self._sample(self._decode([(slot, slot.pending()) for slot in running]))
        return bool(active)

    def _pieces_to_read(self, reading: list[_Slot], *, beside_running: bool) -> list[tuple[_Slot, list[int]]]:
        """This step's prompt pieces (see :meth:`_step`), in the order the jobs were seated."""
        if not beside_running:
            return [(slot, slot.pending()[: self._n_batch]) for slot in reading]
        pieces, budget, cut = [], self.whole, False
        for slot in reading:
            rest = slot.pending()
            if len(rest) <= min(budget, self._n_batch):
                piece = rest
            elif not cut and budget > 0:
                piece, cut = rest[: min(self.chunk, budget)], True
            else:
                continue
            pieces.append((slot, piece))
            budget -= len(piece)
        return pieces

    def _decode(self, pieces: list[tuple[_Slot, list[int]]]) -> list[tuple[_Slot, npt.NDArray[np.single]]]:
        """One llama_decode of each slot's next tokens; the logits of each slot that has read all it holds."""
        import llama_cpp
        import numpy as np

        batch, ends = self._batch, []
        batch.n_tokens = 0
        for slot, tokens in pieces:
            for token in tokens:
                index = batch.n_tokens
                batch.token[index], batch.pos[index] = token, slot.n_past
                batch.n_seq_id[index], batch.seq_id[index][0] = 1, slot.seq
                slot.n_past += 1
                batch.logits[index] = slot.n_past == len(slot.tokens)
                batch.n_tokens += 1
            if slot.n_past == len(slot.tokens):
                ends.append((slot, batch.n_tokens - 1))
        code = llama_cpp.llama_decode(self._ctx, batch)
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code}")
        return [
            (slot, np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self._ctx, index), shape=(self._n_vocab,)))
            for slot, index in ends
        ]

    def _sample(self, drawn: list[tuple[_Slot, npt.NDArray[np.single]]]) -> None:
        """Draw each slot's job's next token from its logits, deliver its text, and end the jobs
        that are over. The draws run on the pool: numpy lets go of the GIL over a vocabulary's
        worth of floats, and eight sampled sequences' softmaxes take 3.6 ms a step on one thread."""
        tokens = self._pool.map(self._choose, drawn) if len(drawn) > 1 else map(self._choose, drawn)
        for (slot, _), token in zip(drawn, tokens, strict=True):
            self._advance(slot, token)

    @staticmethod
    def _choose(drawn: tuple[_Slot, npt.NDArray[np.single]]) -> int | Exception:
        """The slot's job's next token, or the error a processor raised (the job's, as in LlamaRunner)."""
        import numpy as np

        slot, logits = drawn
        assert slot.job is not None
        try:
            return slot.job.choose(np.asarray(slot.tokens, dtype=np.intc), logits)
        except Exception as exc:  # noqa: BLE001
            return exc

    def _advance(self, slot: _Slot, token: int | Exception) -> None:
        """Deliver the text ``token`` completes (create_completion's cut) and end the job when over."""
        job = slot.job
        assert job is not None
        try:
            if isinstance(token, Exception):
                raise token
            job.deliver(job.text.push(token))
        except Exception as exc:  # noqa: BLE001 (a processor's error is the job's, as in LlamaRunner)
            self._release(slot, error=exc)
            return
        if job.text.finish_reason is None and len(slot.tokens) >= self.n_ctx:  # past max_tokens (the multibyte quirk)
            job.deliver(job.text.finish("length"))
        if job.text.finish_reason is not None:
            self._release(slot)
        else:
            slot.tokens.append(token)

    def _release(self, slot: _Slot, error: BaseException | None = None) -> None:
        """End the slot's job; its sequence stays held (its KV may serve a later prompt)."""
        assert slot.job is not None
        job, slot.job = slot.job, None
        slot.tokens, slot.used_at = slot.tokens[: slot.n_past], time.monotonic()
        job.end(error)

    def _forget(self, slot: _Slot) -> None:
        """Clear the slot's KV: it holds nothing."""
        import llama_cpp

        llama_cpp.llama_memory_seq_rm(self._memory, slot.seq, -1, -1)
        slot.tokens, slot.n_past, slot.prompt_len, slot.prompt_logits = [], 0, 0, None

    def _expire_held(self) -> None:
        """Clear each held sequence that has not served a job for ``prompt_cache_seconds``
        (called every step, and at least every IDLE_WAIT_SECONDS while idle)."""
        expired = time.monotonic() - self.prompt_cache_seconds
        for slot in self._slots:
            if slot.job is None and slot.tokens and slot.used_at <= expired:
                self._forget(slot)

    def _drop(self, job: _Job) -> None:
        """A cancelled job: out of the queue, or its sequence freed at once."""
        with self._wake:
            if job in self._waiting:
                self._waiting.remove(job)
                job.end()  # (its grammar's sampler freed: it never had a sequence)
                return
        for slot in self._slots:
            if slot.job is job:
                self._release(slot)
                self._forget(slot)

    def _seat(self, job: _Job) -> None:
        """Give ``job`` a free sequence, starting from the longest prefix of its prompt that any
        sequence holds when it is worth sharing (see :meth:`_worth_sharing`); leave it waiting
        while no sequence is free, or while one still reading the same prompt will hold more of it."""
        free = [slot for slot in self._slots if slot.job is None]
        if not free:
            return
        prompt = job.prompt
        mine = [slot for slot in self._slots if slot.cache_key == job.cache_key]  # (another account's KV is not shared)
        source = max(mine or free, key=lambda slot: slot.prefix(prompt) if slot in mine else 0)
        shared = source.prefix(prompt) if source in mine and self._worth_sharing(source.prefix(prompt), prompt) else 0
        coming = max(
            (
                slot.prefix(prompt, upcoming=True)
                for slot in mine
                if slot.job is not None and slot.n_past < slot.prompt_len
            ),
            default=0,
        )
        if coming > shared and self._worth_sharing(coming, prompt):
            return  # the same prompt is being read: wait for it rather than read it twice
        with self._wake:
            self._waiting.remove(job)
        target = max(free, key=lambda slot: (slot.prefix(prompt) if shared else 0, not slot.tokens, -slot.used))
        self._copy(source, target, shared)
        whole = shared == len(prompt) == source.prompt_len and source.prompt_logits is not None
        self._trim(target, shared if whole else min(shared, len(prompt) - 1))
        target.job, target.used, target.used_at, target.cache_key = job, self._steps, time.monotonic(), job.cache_key
        target.tokens, target.prompt_len = list(prompt), len(prompt)
        job.read = len(prompt) - target.n_past
        target.start_logits = target.prompt_logits = source.prompt_logits if whole else None

    def _worth_sharing(self, shared: int, prompt: list[int]) -> bool:
        """Whether a job starts from ``shared`` tokens of its ``prompt`` held by another sequence:
        the whole prompt (the ``n`` choices of one request), or more than a short prompt. Less is
        read again, in one piece, as LlamaRunner reads it: a prompt read in two pieces gets
        slightly different logits (see :meth:`_step`), which re-reading a short prompt avoids for
        little (every chat shares its template's first tokens with every other)."""
        return shared == len(prompt) or shared > self.whole

    def _copy(self, source: _Slot, target: _Slot, shared: int) -> None:
        """Make ``target``'s KV ``source``'s when that gives it more of the prompt than it has."""
        import llama_cpp

        if source is target or shared <= target.prefix(source.tokens[:shared]):
            return
        llama_cpp.llama_memory_seq_rm(self._memory, target.seq, -1, -1)
        # across streams llama.cpp copies only whole sequences; the tail is trimmed after
        llama_cpp.llama_memory_seq_cp(self._memory, source.seq, target.seq, -1, -1)
        target.tokens, target.n_past = source.tokens[: source.n_past], source.n_past

    def _trim(self, slot: _Slot, keep: int) -> None:
        import llama_cpp

        if slot.n_past > keep:
            llama_cpp.llama_memory_seq_rm(self._memory, slot.seq, keep, -1)
        slot.n_past = min(slot.n_past, keep)
        slot.tokens = slot.tokens[:keep]


def aggregate_tokens_per_second(runner: BatchedLlamaRunner, jobs: list[dict]) -> float:
    """Tokens generated per second by ``jobs`` streamed at once through ``runner`` (each in its
    own thread, as mahout runs them), from their start to the last one's end."""
    counts = [0] * len(jobs)

    def consume(index: int) -> None:
        stream = runner.stream(jobs[index])
        for _ in stream:
            pass
        counts[index] = len(stream.token_ids)

    threads = [threading.Thread(target=consume, args=(index,)) for index in range(len(jobs))]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts) / (time.perf_counter() - start)


def decode_jobs(runner: LlamaRunner, count: int, tokens: int) -> list[dict]:
    """``count`` distinct plain completions of ``tokens`` greedy tokens each (a story: it rarely
    ends early), rendered as the gateway renders a completion for any model (BOS, the text)."""
    bos = runner._llm.detokenize([runner._llm.token_bos()], special=True).decode("utf-8")
    return [
        {
            "id": f"measure-{index}",
            "kind": "completion",
            "fragments": [[bos, True], [f"Story {index + 1}. Once upon a time, in a village by the sea,", False]],
            "params": {"max_tokens": tokens, "temperature": 0.0, "seed": index},
        }
        for index in range(count)
    ]


def slots_measured(
    model_path: str | Path,
    threads: int,
    counts: tuple[int, ...] = (1, 2, 4, 8),
    tokens: int = 64,
    *,
    gpu_layers: int = 0,
) -> dict[int, float]:
    """Aggregate decode tokens/s with each of ``counts`` jobs at once (``tokens`` each) through one
    BatchedLlamaRunner of max(counts) sequences (``gpu_layers`` of the model on the GPU): what
    :func:`slots_chosen` picks from."""
    runner = BatchedLlamaRunner(model_path, threads, n_ctx=256, gpu_layers=gpu_layers, slots=max(counts))
    try:
        runner._vocab_ready.join()  # (the healing vocabulary, built at start, would take the CPU from the first count)
        aggregate_tokens_per_second(runner, decode_jobs(runner, 1, 8))  # warm: first pass, pages, caches
        return {count: aggregate_tokens_per_second(runner, decode_jobs(runner, count, tokens)) for count in counts}
    finally:
        runner.close()


GAIN_WORTH_DOUBLING = 1.15


def slots_chosen(measured: dict[int, float]) -> int:
    """The sequences a host serves at once: the smallest measured S after which doubling gains
    less than 15% of aggregate tokens/s, taken over every larger count measured (a count c beyond
    S must gain less than 1.15 ** log2(c / S) over S), so a plateau between two counts does not
    stop the search early: on this project's 2-core CPU two sequences gain 6% over one while four
    gain 56% and eight 98%. Past S another customer's stream costs the others nearly its whole
    share of the machine, so more slots only slow each stream down."""
    counts = sorted(measured)
    for count in counts:
        if all(
            measured[larger] < measured[count] * GAIN_WORTH_DOUBLING ** math.log2(larger / count)
            for larger in counts
            if larger > count
        ):
            return count
    return counts[-1]
