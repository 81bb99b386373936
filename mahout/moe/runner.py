"""The MoE coordinator node: the whole model, its inference slots, and the dispatch that
sends routed experts to remote workers when the slots are busy.

`MoeRunner` holds the full model (so it can always compute every expert itself), a
`LoadMonitor` that probes its own slots (`busy_slots`), and a `Coordinator` the model asks
for experts. Requests run concurrently, one slot (and one KV cache row) each. Their decode
steps are packed (seed 004: aggregate throughput under load): a request's next token joins
a list of pending steps, and whichever request takes the model next runs every pending step
as the rows of one pass, so each layer's experts — local or on remote workers — compute
for all of them at once and a remote worker sees a batch, not one row per round trip. A
prompt's prefill is a pass of its own. `slot()` gives a `MoeSlot`: the mahout runner interface for one job
at a time (`stream(job)` yields text pieces, then `finish_reason` and `completion_tokens`),
so one host loop per slot can share the runner.

Text and tokens go through the model's own vocabulary (`Vocabulary`), counted as the gateway
counts them: a real one (Qwen 3 MoE's BPE) through llama.cpp's reader of the same file, each
rendered fragment tokenized as text or as its one control token
(`protocol.rendering.fragments_tokens`, `scorer.llama.PromptTokenizer`); the generated
test model's byte vocabulary as its UTF-8 bytes (`engine.moe_loader.ByteTokenizer`).
"""

from __future__ import annotations

import codecs
import itertools
import threading
from collections.abc import Callable, Generator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.gguf_meta import open_gguf
from engine.moe import LocalExperts, MoeModel
from engine.moe_loader import ByteTokenizer, has_byte_vocabulary, load_moe
from engine.tokenizer import Tokenizer
from mahout.moe.coordinator import Coordinator
from mahout.moe.policy import DispatchPolicy, LoadMonitor
from mahout.runners import Piece, job_number, job_seed
from mahout.runners.logprobs import LogprobRecorder, TokenAligner
from protocol.jobs import job_stop_strings
from protocol.rendering import fragments_text
from protocol.sampling import select, select_masked, uniform
from scorer.errors import RequestRejected

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    from llama_cpp import Llama

    from scorer.healing import TokenHealer, Vocab
    from scorer.llama import Grammar

__all__ = ["MoeRunner", "MoeSlot", "SlotsFull", "Vocabulary", "as_streamed"]

GATHER_SECONDS = 0.005  # how long a pass waits for the other decoding requests' steps (a pass here takes ~10 ms)


class SlotsFull(RuntimeError):
    """Every inference slot is taken."""


class Vocabulary:
    """The model's own vocabulary: a job's prompt as ids, ids as text, the ids that end a turn."""

    def __init__(self, model_path: str | Path) -> None:
        self.bytes = has_byte_vocabulary(open_gguf(model_path))
        self.tokenizer: ByteTokenizer | Tokenizer = ByteTokenizer() if self.bytes else Tokenizer(model_path)
        self.eos_id = self.tokenizer.eos_id
        self._prompt = None
        self._ends: frozenset[int] = frozenset()
        self._pieces: list[bytes] | None = None
        self._heal_vocab: Vocab | None = (
            None  # every token's bytes for healing, built for the first job that resumes text
        )
        if not self.bytes:
            from mahout.runners.llama import end_of_generation_ids
            from scorer.llama import PromptTokenizer, pieces_whole

            pieces_whole(self._llama)  # (a token longer than 32 bytes would be spelled as nothing)
            self._prompt = PromptTokenizer(self._llama)
            self._ends = end_of_generation_ids(self._llama)

    @property
    def _llama(self) -> Llama:
        """llama.cpp's vocabulary (a model whose vocabulary is not bytes)."""
        assert isinstance(self.tokenizer, Tokenizer)
        return self.tokenizer.llama

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def spell(self, ids: list[int]) -> bytes:
        """The bytes `ids` write, as llama.cpp's detokenizer writes them (control tokens as nothing)."""
        if isinstance(self.tokenizer, ByteTokenizer):
            return bytes(t for t in ids if t < 256)
        return self.tokenizer.llama.detokenize(ids)

    def pieces(self, n_vocab: int) -> list[bytes]:
        """Every token's bytes as `spell` writes it (for log-probability entries): made once,
        about a second for a 150k-token vocabulary."""
        if self._pieces is None or len(self._pieces) != n_vocab:
            self._pieces = [self.spell([token]) for token in range(n_vocab)]
        return self._pieces

    def prompt(self, job: dict) -> list[int]:
        """The job's rendered prompt as the gateway counted it: fragments through the model's
        own vocabulary, or the text as bytes (and BOS) for a byte vocabulary."""
        if self._prompt is None:
            return self.tokenizer.encode(fragments_text(job.get("fragments") or []))
        return self._prompt.tokens(job)

    def healing(self, job: dict, prompt: list[int]) -> tuple[list[int], TokenHealer | None]:
        """What to feed for `job` (prompt `prompt`) and the healer that writes text again first,
        as a single-machine host does (`scorer.healing.healing`): a continuation's cut last
        word, or under a grammar its whole delivered text (`rewrite`). A byte vocabulary cuts no
        word (a byte is a token) and follows no grammar: nothing to heal."""
        from scorer.healing import Vocab, healing, resumes_text

        if self.bytes or not (job.get("rewrite") or resumes_text(job)):
            return prompt, None
        if self._heal_vocab is None:
            self._heal_vocab = Vocab(self._llama)
        return healing(job, prompt, self._heal_vocab)

    def count(self, text: str) -> int:
        """Tokens in generated text, as the gateway counts them (`scorer.llama.count_tokens`)."""
        from scorer.llama import count_tokens

        return len(text.encode()) if self.bytes else count_tokens(self._llama, text)

    def ends(self, token: int) -> bool:
        """Whether `token` ends a generation as it ends llama.cpp's: EOS or any token its
        vocabulary marks as an end of generation (Qwen's `<|im_end|>`, `</s>`, ...)."""
        return token == self.eos_id or token in self._ends

    def grammar(self, response_format: dict | None) -> Grammar | None:
        """The response_format's grammar over this vocabulary, in its starting state (None: free
        text); refused for a byte vocabulary, which llama.cpp's grammar cannot read."""
        from scorer.llama import Grammar, grammar_for

        spec = grammar_for(response_format)
        if spec is None:
            return None
        if isinstance(self.tokenizer, ByteTokenizer):
            raise RequestRejected("this model's byte vocabulary cannot follow a response_format's grammar")
        return Grammar(self.tokenizer.llama, spec)

    def stop_ids(self, job: dict) -> set[int]:
        """EOS, every token llama.cpp ends a generation at, and the model's end of turn (one
        token each, as the catalog names them)."""
        ends = self._prompt.single_ids(job.get("end_of_turn") or []) if self._prompt is not None else []
        return {self.eos_id, *self._ends, *ends}


class MoeRunner:
    def __init__(
        self,
        model_path: str | Path,
        *,
        policy: DispatchPolicy | None = None,
        n_slots: int = 4,
        n_ctx: int | None = None,
        probe: Callable[[], int] | None = None,
        pack: bool = True,
    ) -> None:
        self.policy = policy or DispatchPolicy()
        self.config, weights = load_moe(model_path)
        local = LocalExperts({layer.index: layer.experts for layer in weights.layers if layer.experts is not None})
        self.monitor = LoadMonitor(probe or self.busy_slots, self.policy)
        self.coordinator = Coordinator(local, monitor=self.monitor)
        n_ctx = n_ctx or self.config.context_length  # what the gateway's catalog entry promises (a host may cap it)
        if not 0 < n_ctx <= self.config.context_length:
            raise ValueError(
                f"a context of {n_ctx} tokens is not in 1..{self.config.context_length}, the model's context length"
            )
        self.model = MoeModel(self.config, weights, experts=self.coordinator, n_rows=n_slots, n_ctx=n_ctx)
        self.tokenizer = Vocabulary(model_path)
        self.n_slots = n_slots
        self._busy = 0
        self._slots = threading.Lock()
        self._model = threading.Lock()
        self._ids = itertools.count()
        self._pending: list[_Step] = []  # decode steps waiting for the next pass
        self._gather = threading.Condition()  # guards _pending, _decoding and _stepping
        self._decoding = 0  # requests past their prefill: the steps a full pass would carry
        self._stepping = False  # a decode pass is being gathered or run
        self.pack = pack  # False: one request's step per pass (the measured baseline, bench/moe.py)
        self.passes = 0  # decode passes run, and the rows they carried: rows ÷ passes is the mean batch
        self.rows = 0

    def start(self) -> MoeRunner:
        self.monitor.start()
        return self

    def kv_cache_mib(self) -> float:
        """The KV cache's memory: every slot holds keys and values for the whole context."""
        cache = self.model.cache
        return (cache.k.numel() * cache.k.element_size() + cache.v.numel() * cache.v.element_size()) / 2**20

    def busy_slots(self) -> int:
        """The self-probe: inference slots now holding a request."""
        return self._busy

    def generate(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        """Greedy completion in a slot of its own; steps interleave with other requests'."""
        return list(self.generate_stream(prompt_ids, max_tokens))

    def generate_stream(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        grammar: Grammar | None = None,
        healer: TokenHealer | None = None,
        watch: Callable[[npt.NDArray[np.float32]], object] | None = None,
    ) -> Generator[int, None, None]:
        """The completion's tokens as they are drawn, each by the specified sampler
        (`protocol.sampling`: ``select`` with the draw ``uniform(seed, position)``, position
        the tokens before it), as a single-machine host draws them; temperature 0 is greedy.
        Under a `grammar` (a response_format's, in the state after the prompt), the draw is
        ``select_masked``'s over the tokens it allows, each token fed to it before the next draw:
        `mahout.runners.llama.GrammarSampler`'s rule, so a verifier replays it alike. While a
        `healer` writes text again, only the tokens it allows are drawn from (the others' logits
        -inf first, as a single-machine host's healer masks them). `watch` sees each step's own
        logits before the draw (a log-probability recorder)."""
        from mahout.ring.vocab import Healing

        healing = Healing(healer) if healer is not None else None
        request = f"r{next(self._ids)}"
        with self._slots:
            if self._busy >= self.n_slots:
                raise SlotsFull(f"all {self.n_slots} slots are busy")
            self._busy += 1
        try:
            with self._model:
                row = self.model.cache.assign(request)
                logits = self._step(torch.tensor(prompt_ids), 0, row)
            with self._gather:
                self._decoding += 1
            try:
                for step in range(max_tokens):
                    scores, u = logits.float().numpy(), uniform(seed, len(prompt_ids) + step)
                    if watch is not None:
                        watch(scores)
                    healed = healing.masked(logits) if healing is not None else logits
                    masked = healed is not logits  # (the healer still writes text again)
                    if masked:
                        scores = healed.numpy()
                    try:
                        token = (
                            select(scores, temperature=temperature, top_p=top_p, u=u)
                            if grammar is None
                            else select_masked(scores, grammar.allowed, temperature=temperature, top_p=top_p, u=u)
                        )
                    except ValueError as exc:  # the grammar refuses every token the healer allows
                        if not masked:
                            raise
                        raise RequestRejected(
                            "the text already delivered does not follow the response_format's grammar"
                        ) from exc
                    if healing is not None:
                        healing.wrote(token)
                    yield token
                    if self.tokenizer.ends(token) or step == max_tokens - 1:
                        return
                    if grammar is not None:
                        grammar.accept(token)
                    logits = self._decode(token, len(prompt_ids) + step, row)
            finally:
                with self._gather:
                    self._decoding -= 1
                    self._gather.notify_all()
        finally:
            with self._model:
                self.model.cache.release(request)
            with self._slots:
                self._busy -= 1

    def _decode(self, token: int, position: int, row: int) -> torch.Tensor:
        """One decode step, packed with every other request's pending step: the logits (V,).
        When no pass is running, this request runs the next one: it waits (at most GATHER_SECONDS)
        until every decoding request has its step pending, then runs them all as the rows of
        one pass. Otherwise it waits for the running pass to end (its step may be in it)."""
        step = _Step(token, position, row)
        with self._gather:
            self._pending.append(step)
            self._gather.notify_all()
            while not step.done.is_set():
                if self._stepping:
                    self._gather.wait()
                    continue
                self._stepping = True
                try:
                    if self.pack:
                        self._gather.wait_for(lambda: len(self._pending) >= self._decoding, timeout=GATHER_SECONDS)
                        batch, self._pending = self._pending, []
                    else:
                        batch = [step]
                        self._pending = [s for s in self._pending if s is not step]
                    self._gather.release()
                    try:
                        with self._model:
                            self._run(batch)
                    finally:
                        self._gather.acquire()
                finally:
                    self._stepping = False
                    self._gather.notify_all()
        if step.error is not None:
            raise step.error
        assert step.logits is not None
        return step.logits

    def _run(self, batch: list[_Step]) -> None:
        """Under the model lock: one pass for `batch` (one token per row), each step handed its logits."""
        try:
            logits = self.model(
                torch.tensor([s.token for s in batch]),
                torch.tensor([s.position for s in batch]),
                torch.tensor([s.row for s in batch]),
            )  # (B, V)
            for index, s in enumerate(batch):
                s.logits = logits[index]
            self.passes += 1
            self.rows += len(batch)
        except Exception as exc:  # noqa: BLE001 - every request of the pass gets the error, not only the one that ran it
            for s in batch:
                s.error = exc
        finally:
            for s in batch:
                s.done.set()

    def _step(self, tokens: torch.Tensor, start: int, row: int) -> torch.Tensor:
        # tokens: (T,) -> logits of the last token (V,)
        n = tokens.shape[0]
        positions = torch.arange(start, start + n)
        return self.model(tokens, positions, torch.full((n,), row), torch.tensor([n - 1]))[0]

    def slot(self) -> MoeSlot:
        """A runner-interface view for one host loop (its own finish_reason and token count)."""
        return MoeSlot(self)

    def close(self) -> None:
        self.monitor.stop()
        self.coordinator.close()


class _Step:
    """One request's pending decode step and, once a pass ran it, its logits (or the error)."""

    __slots__ = ("done", "error", "logits", "position", "row", "token")

    def __init__(self, token: int, position: int, row: int) -> None:
        self.token, self.position, self.row = token, position, row
        self.logits: torch.Tensor | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()


class MoeSlot:
    """The mahout runner interface over a shared `MoeRunner`, one job at a time: each host
    loop holds its own slot, so concurrent jobs never share `finish_reason`."""

    def __init__(self, runner: MoeRunner) -> None:
        self.runner = runner
        self.finish_reason = "stop"
        self.completion_tokens = 0
        self.token_ids: list[
            int
        ] = []  # the last job's drawn tokens, its end of turn included (`mahout.loop` reports them)
        self.seed: int | None = None  # the seed they were drawn with (the job's, or drawn here when it had none)

    def stream(self, job: dict) -> Generator[str, None, None]:
        """Text for a chat or completion job, drawn at the job's temperature and top_p with
        its seed by the specified sampler (as a single-machine host draws), under the
        response_format's grammar when it has one, ended by EOS, the model's end of turn or a
        stop string (the text ends where it starts; the token that completed it is the last
        reported). The text is what llama.cpp's stream writes for those tokens (bytes that are
        no UTF-8 dropped, an unfinished character at the end held back), so an audit reads it as
        a single-machine host's. Text a job resumes is healed as a single-machine host heals it
        (`Vocabulary.healing`): a continuation's cut last word, or under a grammar its whole
        delivered text (`rewrite`), is written again first under the healer's mask and not
        streamed (mahout 0.7.0; before, the cut word was continued as counted and a rewrite
        read into the prompt, which no verifier replays). With
        `logprobs`, each piece ends on a token boundary and carries its tokens' entries (`Piece`,
        from the model's own logits before any grammar), as a single-machine host's does."""
        runner = self.runner
        params = job.get("params") or {}
        prompt = runner.tokenizer.prompt(job)
        stops = runner.tokenizer.stop_ids(job)
        grammar = runner.tokenizer.grammar(params.get("response_format"))
        prompt, healer = runner.tokenizer.healing(job, prompt)
        try:
            if params.get("logprobs") is None:
                for text in self._stream(job, prompt, stops, grammar, healer):
                    text = healer.strip(text) if healer is not None else text  # (the customer has that text already)
                    if text:
                        yield text
            else:
                yield from self._with_logprobs(job, prompt, stops, grammar, healer, top=int(params["logprobs"]))
        finally:
            if grammar is not None:
                grammar.close()
        rewrite = job.get("rewrite") or ""
        if rewrite:  # the tokens the customer gets from this host, not those that wrote the delivered text again
            spelled = runner.tokenizer.spell([t for t in self.token_ids if t not in stops]).decode(
                "utf-8", errors="ignore"
            )
            self.completion_tokens = runner.tokenizer.count(spelled.removeprefix(rewrite))

    def _with_logprobs(
        self,
        job: dict,
        prompt: list[int],
        stops: set[int],
        grammar: Grammar | None,
        healer: TokenHealer | None,
        *,
        top: int,
    ) -> Generator[str, None, None]:
        """`_stream`'s text cut on token boundaries, each piece with its tokens' entries."""
        import numpy as np

        recorder = LogprobRecorder(prompt_len=0, top=top)  # (fed the drawn tokens alone: no prompt copied a step)

        def watch(scores: npt.NDArray[np.float32]) -> None:
            recorder(np.asarray(self.token_ids, dtype=np.intc), scores)  # it learns the last draw from these

        aligner = TokenAligner(
            recorder,
            self.runner.tokenizer.pieces(self.runner.config.vocab_size),
            skip=len(healer.pending) if healer is not None else 0,
        )
        for raw in self._stream(job, prompt, stops, grammar, healer, watch=watch):
            text, entries = aligner.feed(raw)
            if text or entries:
                yield Piece(text, entries)
        if recorder.steps and recorder.steps[-1].token is None and len(self.token_ids) == len(recorder.steps):
            recorder.steps[-1].choose(self.token_ids[-1])  # the last draw: no step after it told the recorder
        text, entries = aligner.finish()
        if text or entries:
            yield Piece(text, entries)

    def _stream(
        self,
        job: dict,
        prompt: list[int],
        stops: set[int],
        grammar: Grammar | None,
        healer: TokenHealer | None = None,
        *,
        watch: Callable[[npt.NDArray[np.float32]], object] | None = None,
    ) -> Generator[str, None, None]:
        runner = self.runner
        params = job.get("params") or {}
        budget = runner.model.cache.n_ctx - len(prompt)
        if budget <= 0:  # (as a single-machine host says it: the customer gets the reason)
            raise RequestRejected(
                f"prompt is {len(prompt)} tokens; the context window is {runner.model.cache.n_ctx} tokens"
            )
        from scorer.healing import rewrite_budget

        max_tokens = min(
            rewrite_budget(job, min(int(params.get("max_tokens") or budget), budget), runner.tokenizer.count), budget
        )
        temperature, top_p = job_number(params, "temperature", 1.0), job_number(params, "top_p", 1.0)
        self.finish_reason, self.completion_tokens = "length", 0
        self.seed, self.token_ids = job_seed(params), []
        stop_strings = [stop for stop in job_stop_strings(job) if stop]
        decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")
        text, sent = "", 0
        for token in runner.generate_stream(
            prompt,
            max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=self.seed,
            grammar=grammar,
            healer=healer,
            watch=watch,
        ):
            self.token_ids.append(token)
            self.completion_tokens += 1
            if token in stops:
                self.finish_reason = "stop"
                break
            text += decoder.decode(runner.tokenizer.spell([token]))  # an unfinished character waits in the decoder
            at = min((found for stop in stop_strings if (found := text.find(stop)) >= 0), default=None)
            if at is not None:  # the text ends where the stop string starts; the token that completed it is reported
                if at > sent:
                    yield text[sent:at]
                self.finish_reason = "stop"
                return
            ready = len(text) - _stop_start(text, stop_strings)  # what could begin a stop string waits
            if ready > sent:
                yield text[sent:ready]
                sent = ready
        if len(text) > sent:  # held back for a stop string that did not come
            yield text[sent:]


def as_streamed(spelled: bytes) -> str:
    """The text a stream delivers for `spelled` (no stop string met): as llama.cpp's stream
    writes it, bytes that are no UTF-8 dropped and an unfinished character at the end held back."""
    return codecs.getincrementaldecoder("utf-8")(errors="ignore").decode(spelled)


def _stop_start(text: str, stops: list[str]) -> int:
    """How many characters at the end of `text` could be the start of one of `stops`."""
    return max(
        (
            size
            for stop in stops
            for size in range(min(len(stop) - 1, len(text)), 0, -1)
            if stop.startswith(text[-size:])
        ),
        default=0,
    )
