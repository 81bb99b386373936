"""A llama.cpp model as hosts load and read it: the loader (`load_llama`), a job's prompt as
token ids (`PromptTokenizer`), a `response_format`'s grammar (`grammar_for`, `Grammar`) and
generated text counted (`count_tokens`). A host's runner samples with these, and the verifier
(`scorer.verify`) replays with the same ones.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from protocol.grammar_fence import FenceUnavailable, GrammarFence
from protocol.rendering import fragments_tokens
from scorer.errors import RequestRejected

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    from llama_cpp import Llama

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
    model_path: str | Path,
    *,
    n_ctx: int,
    threads: int,
    logits_all: bool = False,
    gpu_layers: int = 0,
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
                model_path=str(model_path),
                n_ctx=n_ctx,
                n_threads=threads,
                n_threads_batch=threads,
                verbose=False,
                logits_all=logits_all,
                n_gpu_layers=gpu_layers,
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

    model.detokenize = detokenize  # type: ignore[method-assign]  # this one model's, on purpose


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
            llama_cpp.llama_model_get_vocab(llm.model),
            grammar._grammar.encode("utf-8"),  # type: ignore[attr-defined]
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


class PromptTokenizer:
    """A job's rendered prompt as this model's token ids: the one tokenization the gateway
    counts with (`protocol.rendering.fragments_tokens`), over llama.cpp's vocabulary."""

    def __init__(self, llm: Llama) -> None:
        self._llm = llm
        self._controls: dict[str, int] = {}

    def tokens(self, job: dict) -> list[int]:
        fragments = job.get("fragments")
        if not isinstance(fragments, list):
            raise RequestRejected(
                "the job carries no rendered prompt (`fragments`): the gateway is older than this host"
            )
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


def count_tokens(llm: Llama, text: str) -> int:
    """Tokens in generated text, counted as the gateway counts them (re-tokenized)."""
    return len(llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)) if text else 0
