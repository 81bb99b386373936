"""llama.cpp runner: one GGUF model loaded once, streaming one job at a time.

The prompt arrives rendered by the gateway in the model's own chat template (the job's
`fragments`, :mod:`protocol.rendering`: the rendering the gateway counted), is tokenized
here by :class:`PromptTokenizer` (text as text, each of the template's control tokens as
itself: a customer's text never becomes one), and is handed to llama-cpp-python as token
ids. Passing ids lets us check the context window before any compute.
"""
from __future__ import annotations

import json
import os
import threading
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, cast

from mahout.runners import Piece, RequestRejected, job_number, job_seed
from mahout.runners.logprobs import LogprobRecorder, TokenAligner
from protocol.grammar_fence import FenceUnavailable, GrammarFence
from protocol.jobs import CHAT, job_stop_strings
from protocol.rendering import fragments_tokens
from protocol.sampling import select, select_masked, uniform

if TYPE_CHECKING:
    from collections.abc import Callable

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


def load_llama(
    model_path: str | Path, *, n_ctx: int, threads: int, logits_all: bool = False, gpu_layers: int = 0,
) -> Llama:
    """Load a GGUF with llama-cpp-python, quietly, with ``threads`` for prompt and generation
    (``logits_all`` keeps every position's logits, for log-probabilities: the gateway's canary
    references) and ``gpu_layers`` of its layers on the GPU (llama.cpp's n_gpu_layers).

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
            llm = llama_module.Llama(
                model_path=str(model_path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False,
                logits_all=logits_all, n_gpu_layers=gpu_layers,
            )
        finally:
            llama_module.llama_cpp.llama_model_default_params = original
    pieces_whole(llm)
    return llm


def pieces_whole(llm: Llama) -> None:
    """Make `llm` write every token's whole text. llama-cpp-python writes each token into a
    32-byte buffer and drops the text of a longer one: Llama 3 has tokens of up to 128
    characters (runs of spaces and dashes in code), which a host would silently leave out of
    an answer. Its model's `detokenize` (what streaming, `Llama.detokenize` and the verifier
    read) is replaced by one that sizes the buffer to the token. A vocabulary-only `Llama`
    that spells a ring's or an MoE coordinator's tokens needs it as much."""
    import ctypes

    import llama_cpp

    model = llm._model
    vocab, bos = model.vocab, model.token_bos()

    def detokenize(tokens: list[int], special: bool = False) -> bytes:
        output, buffer = bytearray(), ctypes.create_string_buffer(256)
        for token in tokens:
            written = llama_cpp.llama_token_to_piece(vocab, token, buffer, len(buffer), 0, special)
            if written < 0:  # -written bytes are needed
                buffer = ctypes.create_string_buffer(-written)
                written = llama_cpp.llama_token_to_piece(vocab, token, buffer, len(buffer), 0, special)
            output += buffer.raw[:written]
        # as the library's own: a leading space after BOS (Llama 1's prompts) is dropped
        return bytes(output[1:] if tokens and tokens[0] == bos and output[:1] == b" " else output)

    model.detokenize = detokenize




LOOSE_CHAR = 'char ::= [^"\\\\]'  # llama-cpp-python's converter: any character but " and \\ in a string...
STRICT_CHAR = 'char ::= [^"\\\\\\x7F\\x00-\\x1F]'  # ...JSON forbids control characters there too


def strict_json_strings(gbnf: str) -> str:
    """The converter's grammar with JSON's own string rule: llama-cpp-python's JSON-schema
    converter lets a raw newline (or any control character) into a string, which no JSON
    parser takes, so a host sampling under it could be failed for an answer its grammar
    allowed (seen: a newline inside a hobby). llama.cpp's own JSON grammar already forbids them."""
    return gbnf.replace(LOOSE_CHAR, STRICT_CHAR)


# The host converts schemas behind the same fence as the gateway (`protocol.grammar_fence`), a
# little more generously in time (a host's CPU may be slower than the gateway's): a gateway
# that did not check, or checked with another converter, cannot hang or exhaust a host.
GRAMMAR_SECONDS = float(os.environ.get("MAHOUT_GRAMMAR_SECONDS") or 10.0)
_FENCE = GrammarFence(memory_mb=int(os.environ.get("MAHOUT_GRAMMAR_MEMORY_MB") or 1024))


def grammar_for(response_format: dict | None, *, fenced: bool = True) -> object | None:
    """llama.cpp's grammar for a `response_format` (None: free text). The gateway checked
    that the schema converts; a host whose llama.cpp still refuses it (or cannot convert it
    within GRAMMAR_SECONDS) rejects the request (the customer's, not a failure of the host).
    ``fenced`` False converts in this process: for a process that may not start the fence's
    child (a Celery worker's is daemonic) and reads only schemas the gateway's fence converted."""
    if not response_format:
        return None
    from llama_cpp.llama_grammar import JSON_GBNF, LlamaGrammar, json_schema_to_gbnf

    from protocol.schema_limits import schema_limit_problem

    too_much = schema_limit_problem(response_format.get("schema") or {}, patterns=False)
    if too_much:  # past these llama.cpp's grammar parser gives up, and llama-cpp-python then crashes
        raise RequestRejected(f"response_format's schema is over this host's limits: {too_much}")
    try:
        if response_format.get("type") == "json_object":
            return LlamaGrammar.from_string(JSON_GBNF, verbose=False)
        schema = json.dumps(response_format.get("schema") or {})
        gbnf = _FENCE.convert(schema, seconds=GRAMMAR_SECONDS) if fenced else json_schema_to_gbnf(schema)
        return LlamaGrammar.from_string(strict_json_strings(gbnf), verbose=False)
    except FenceUnavailable:
        raise  # this host's trouble, not the request's
    except Exception as exc:  # noqa: BLE001 (the converter raises whatever it meets)
        raise RequestRejected(f"response_format cannot be made into a grammar here: {exc}") from exc


class Grammar:
    """llama.cpp's grammar matcher for one answer: which tokens it allows in its current state
    (:meth:`allowed`, the ``allowed`` of :func:`protocol.sampling.select_masked`) and the
    tokens drawn, fed to it in order (:meth:`accept`). A host samples under it; a verifier
    replays it over the delivered tokens. Asking about every token of Gemma 3's 262,144 costs
    about 0.1 s, the 1,024 likeliest about 0.3 ms (``bench/constrained_audit.py`` measures it),
    which is why ``select_masked`` asks about the likeliest first."""

    def __init__(self, llm: Llama, grammar: object) -> None:
        import llama_cpp
        import numpy as np

        self._lib = llama_cpp
        self._sampler = llama_cpp.llama_sampler_init_grammar(
            llama_cpp.llama_model_get_vocab(llm.model), grammar._grammar.encode("utf-8"),  # type: ignore[attr-defined]
            grammar._root.encode("utf-8"),  # type: ignore[attr-defined]
        )
        if not self._sampler:
            raise RequestRejected("llama.cpp could not build the response_format's grammar")
        self._dtype = np.dtype([("id", np.intc), ("logit", np.single), ("p", np.single)], align=True)
        self._all = np.zeros(llm.n_vocab(), dtype=self._dtype)
        self._all["id"] = np.arange(llm.n_vocab(), dtype=np.intc)

    def close(self) -> None:
        if self._sampler is not None:
            self._lib.llama_sampler_free(self._sampler)
            self._sampler = None

    def accept(self, token: int) -> None:
        """Advance past ``token``, which :meth:`allowed` must allow (llama.cpp aborts the
        process on one it refuses)."""
        self._lib.llama_sampler_accept(self._sampler, int(token))

    def allowed(self, ids: npt.NDArray[np.intp]) -> npt.NDArray[np.bool_]:
        """For each of ``ids``, whether the grammar allows it next."""
        import numpy as np

        if len(ids) == len(self._all):  # every token, in order: the array kept for it
            data = self._all
        else:
            data = np.zeros(len(ids), dtype=self._dtype)
            data["id"] = ids
        data["logit"] = 0.0
        self._apply(data)
        return np.isfinite(data["logit"])

    def _apply(self, data: npt.NDArray[np.void]) -> None:
        """Let the grammar mark the tokens it refuses (logit −inf) in the token data ``data``."""
        import ctypes

        pointer = ctypes.cast(data.ctypes.data, ctypes.POINTER(self._lib.llama_token_data))
        array = self._lib.llama_token_data_array(data=pointer, size=len(data), selected=-1, sorted=False)
        self._lib.llama_sampler_apply(self._sampler, ctypes.byref(array))


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
        choice = select_masked(scores, self.grammar.allowed, temperature=self.temperature, top_p=self.top_p,
                               u=uniform(self.seed, len(input_ids)))
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
        return len(produced) >= len(self.dropped) or self.vocab.fits(token, self.dropped[len(produced):])

    def processors(self) -> LogitsProcessorList:
        import numpy as np
        from llama_cpp import LogitsProcessorList

        def rewrite_dropped_text(input_ids: npt.NDArray[np.intc], scores: npt.NDArray[np.single]) -> npt.NDArray[np.single]:
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


class PromptTokenizer:
    """A job's rendered prompt as this model's token ids: the one tokenization the gateway
    counts with (`protocol.rendering.fragments_tokens`), over llama.cpp's vocabulary."""

    def __init__(self, llm: Llama) -> None:
        self._llm = llm
        self._controls: dict[str, int] = {}

    def tokens(self, job: dict) -> list[int]:
        fragments = job.get("fragments")
        if not isinstance(fragments, list):
            raise RequestRejected("the job carries no rendered prompt (`fragments`): the gateway is older than this host")
        return fragments_tokens(fragments, tokenize=self._plain, control=self._control)

    def single_ids(self, texts: list[str]) -> list[int]:
        """The ids of those texts that are one token of this vocabulary (a model's end of turn)."""
        found = []
        for text in texts:
            ids = self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
            found += ids if len(ids) == 1 else []
        return found

    def _plain(self, text: str) -> list[int]:
        return self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)

    def _control(self, text: str) -> int:
        found = self._controls.get(text)
        if found is None:
            ids = self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
            if len(ids) != 1:  # the catalog's file has it: this host's file is not the catalog's
                raise RequestRejected(f"{text!r} is not one token of this model's vocabulary")
            found = self._controls[text] = ids[0]
        return found


def end_of_generation_ids(llm: Llama) -> frozenset[int]:
    """Every token llama.cpp ends a generation at (`llama_vocab_is_eog`: EOS, EOT and the like,
    e.g. Qwen's `<|im_end|>` and `</s>`), for a host that samples outside llama.cpp's loop (a
    ring, an MoE coordinator) to stop where a single-machine host stops."""
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    return frozenset(token for token in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, token))


def count_tokens(llm: Llama, text: str) -> int:
    """Tokens in generated text, counted as the gateway counts them (re-tokenized)."""
    return len(llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)) if text else 0


class ContextOverflowError(RequestRejected):
    """The rendered prompt does not fit in the model's context window."""


class LlamaRunner:
    """Streams completions for jobs from a GGUF model loaded once and reused."""

    def __init__(self, model_path: str | Path, threads: int, n_ctx: int = 4096, gpu_layers: int = 0) -> None:
        self.model_path = Path(model_path)
        self.n_ctx = n_ctx
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
            raise ContextOverflowError(
                f"prompt is {len(tokens)} tokens; the context window is {self.n_ctx} tokens"
            )
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
                matcher, prompt_len=len(tokens), seed=self.seed, temperature=temperature, top_p=top_p)
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
            if matcher is not None:
                matcher.close()
        text = "".join(pieces)
        self.completion_tokens = max_tokens if self.finish_reason == "length" and not rewrite else count_tokens(self._llm, text)
