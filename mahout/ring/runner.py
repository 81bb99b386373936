"""The ring as a mahout runner: ``RingRunner.stream(job)`` feeds a job to the ring through its
bridge and streams the answer as a single-machine host's runner does; `ring_benchmark` is
the ring's qualifying run. `mahout.ring.serve` drives them as one mahout host.

The runner counts and detokenises with the served model's own vocabulary (the gateway renders
the prompt with the entry's template and sends the fragments). A stage dying raises
`RingBroken` out of ``stream``, which the host loop reports as the job's failure.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Generator
from pathlib import Path

from mahout.ring.bridge import RingBridge, RingRequest
from mahout.ring.membership import GRAMMAR_MAX_BYTES
from mahout.runners import Piece
from mahout.runners.llama import end_of_generation_ids
from mahout.runners.logprobs import LogprobRecorder, Step, TokenAligner
from scorer.errors import RequestRejected
from scorer.healing import Vocab, healing, resumes_text, rewrite_budget
from scorer.llama import PromptTokenizer, count_tokens, grammar_for, pieces_whole

__all__ = ["RingRunner", "ring_benchmark"]

_BENCH_PROMPT = (
    "The history of the elephant is long and varied. Elephants live in families led by the "
    "oldest female, travel great distances in search of water, and remember the routes for decades."
)


class RingRunner:
    """Streams a job's completion from the ring; sets ``finish_reason`` and ``completion_tokens``."""

    def __init__(self, bridge: RingBridge, model_path: str | Path, *, n_ctx: int) -> None:
        from llama_cpp import Llama

        self.bridge = bridge
        self.n_ctx = n_ctx
        self._vocab = Llama(model_path=str(model_path), vocab_only=True, verbose=False)
        pieces_whole(self._vocab)  # (a token longer than 32 bytes would be spelled as nothing)
        self._prompt = PromptTokenizer(self._vocab)
        self._eos = self._vocab.token_eos()
        self._ends = {self._eos, *end_of_generation_ids(self._vocab)}  # where a single-machine host stops
        self._stop_ids = set(self._ends)
        self.finish_reason = "stop"
        self.completion_tokens = 0
        self.token_ids: list[int] = []  # the last job's drawn tokens, reported for its audit (`mahout.loop`)
        self.seed: int | None = None  # the seed they were drawn with (the gateway's, in the job)
        self._pieces_bytes: list[bytes] | None = None  # every token's bytes, once a job asks for log-probabilities
        self._vocab_pieces: Vocab | None = None  # the same, for healing, once a job resumes text

    def _decode(self, ids: list[int]) -> str:
        return self._vocab.detokenize(ids).decode("utf-8", errors="replace")

    def stream(self, job: dict) -> Generator[str, None, None]:
        params = job.get("params") or {}
        grammar = grammar_for(params.get("response_format"))  # (a schema this host cannot follow: the request's fault)
        if grammar is not None and len(grammar._grammar.encode("utf-8")) > GRAMMAR_MAX_BYTES:  # type: ignore[attr-defined]
            raise RequestRejected(f"the response_format's grammar is over the {GRAMMAR_MAX_BYTES} bytes a ring carries")
        prompt = self._prompt.tokens(job)
        budget = self.n_ctx - len(prompt)
        if budget <= 0:
            raise ValueError(f"prompt is {len(prompt)} tokens; the ring's context window is {self.n_ctx} tokens")
        max_tokens = min(int(params.get("max_tokens") or budget), budget)
        rewrite = job.get("rewrite") or ""  # a continuation under a grammar: the delivered text, written again unseen
        max_tokens = min(rewrite_budget(job, max_tokens, self._count), budget)
        healer = None
        if rewrite or resumes_text(
            job
        ):  # written again first (its cut last word, or a rewrite), as a single-machine host does
            prompt, healer = healing(job, prompt, self._heal_vocab())
            if healer is not None and 2 * len(healer.dropped) > GRAMMAR_MAX_BYTES:  # (sent as hex ahead of the rows)
                raise RequestRejected(
                    f"the text to write again is over the {GRAMMAR_MAX_BYTES // 2} bytes a ring carries"
                )
        stops = [s for s in (params.get("stop") or []) if s]
        self._stop_ids = {*self._ends, *self._prompt.single_ids(job.get("end_of_turn") or [])}
        temperature, logprobs = params.get("temperature"), params.get("logprobs")
        self.finish_reason, self.completion_tokens = "length", 0
        self.token_ids, self.seed = [], params.get("seed")
        request = self.bridge.submit(
            prompt,
            max_tokens,
            stop_ids=sorted(self._stop_ids),
            temperature=1.0 if temperature is None else float(temperature),
            top_p=1.0 if params.get("top_p") is None else float(params["top_p"]),
            seed=params.get("seed"),
            logprobs=None if logprobs is None else int(logprobs),
            grammar=None if grammar is None else grammar._grammar,  # type: ignore[attr-defined]
            grammar_root="root" if grammar is None else grammar._root,  # type: ignore[attr-defined]
            # stages keep evidence under it (`mahout.ring.evidence`)
            request_id=f"job-{job.get('id')}-{uuid.uuid4().hex[:8]}",
            heal=healer.dropped if healer is not None else None,
        )
        try:
            if logprobs is None:
                for text in self._pieces(request, stops):
                    text = healer.strip(text) if healer is not None else text  # (the customer has that word already)
                    if text:
                        yield text
            else:
                yield from self._logprob_pieces(request, stops, skip=len(healer.pending) if healer is not None else 0)
        finally:
            if request.finish_reason is None:  # a stop string, or the loop let go: free the ring's rows
                self.bridge.cancel(request.id)
        if rewrite:  # the tokens the customer gets from this host, not those that wrote the delivered text again
            self.completion_tokens = self._count(
                self._decode(self.token_ids[: self.completion_tokens]).removeprefix(rewrite)
            )

    def _count(self, text: str) -> int:
        return count_tokens(self._vocab, text)

    def _heal_vocab(self) -> Vocab:
        """Every token's bytes, for healing (built on the first job that resumes text)."""
        if self._vocab_pieces is None:
            self._vocab_pieces = Vocab(self._vocab)
        return self._vocab_pieces

    def _logprob_pieces(self, request: RingRequest, stops: list[str], *, skip: int = 0) -> Generator[Piece, None, None]:
        """`_pieces`, each ending on a token boundary with its tokens' log-probabilities (the
        tail's, `mahout.ring.vocab.report`), as a single-machine host streams them."""
        recorder = LogprobRecorder(prompt_len=0, top=0)  # (its steps only: the tail computed them)
        aligner = TokenAligner(recorder, self._token_bytes(), skip=skip)

        def known() -> None:  # a step for each token delivered so far (a stop token is not)
            for entry in request.logprobs[len(recorder.steps) : len(self.token_ids)]:
                entry = entry or {"logprob": 0.0, "top": []}  # (a tail that sent none: an audit compares them)
                recorder.steps.append(
                    Step(
                        top=[(int(t), float(lp)) for t, lp in entry["top"]],
                        logprobs=None,
                        token=self.token_ids[len(recorder.steps)],
                        logprob=float(entry["logprob"]),
                    )
                )

        for text in self._pieces(request, stops):
            known()
            out, entries = aligner.feed(text)
            if out or entries:
                yield Piece(out, entries)
        known()
        out, entries = aligner.finish()
        if out or entries:
            yield Piece(out, entries)

    def _token_bytes(self) -> list[bytes]:
        """Every token's bytes (computed on the first job that asks for log-probabilities)."""
        if self._pieces_bytes is None:
            self._pieces_bytes = [self._vocab.detokenize([i]) for i in range(self._vocab.n_vocab())]
        return self._pieces_bytes

    def _pieces(self, request: RingRequest, stops: list[str]) -> Generator[str, None, None]:
        ids = self.token_ids  # (filled as drawn: what an audit re-reads)
        sent, ended = "", None
        for token in request:
            if token in self._stop_ids:
                self.finish_reason, ended = "stop", token
                break
            ids.append(token)
            text = self._decode(ids)
            cut = min((text.find(s) for s in stops if s in text), default=-1)
            if cut >= 0:  # a custom stop string: deliver up to it; stream() cancels the rest
                self.finish_reason = "stop"
                if cut > len(sent):
                    yield text[len(sent) : cut]
                self.completion_tokens = len(ids)
                return
            if text.endswith("\ufffd"):  # half a UTF-8 character: wait for the rest
                continue
            if len(text) > len(sent):
                yield text[len(sent) :]
                sent = text
        text = self._decode(ids)
        if len(text) > len(sent):
            yield text[len(sent) :]
        self.completion_tokens = len(ids)
        if ended is not None:  # reported with the answer, as a single-machine host reports its end of generation:
            ids.append(ended)  # the audit reads an answer that ends on none as cut short


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def ring_benchmark(
    bridge: RingBridge, runner: RingRunner, *, threads: int, pids: list[int], gen_tokens: int = 32
) -> dict:
    """Qualify the ring as mahout's benchmark does: prompt tokens/s, time to first token and
    generation tokens/s of one greedy request, memory of every stage process."""
    prompt = runner._vocab.tokenize(_BENCH_PROMPT.encode(), add_bos=True, special=False)
    started = time.perf_counter()
    request = bridge.submit(prompt, gen_tokens)
    first = end = started
    for n, _ in enumerate(request, start=1):
        end = time.perf_counter()
        if n == 1:
            first = end
    ttft = first - started
    own = _rss_mb(os.getpid())  # not ru_maxrss: Linux carries it over from a big parent across exec
    return {
        "prompt_tps": round(len(prompt) / ttft, 1),
        "gen_tps": round((len(request.tokens) - 1) / max(end - first, 1e-9), 1),
        "ttft_ms": round(ttft * 1000, 1),
        "memory_mb": round(own + sum(_rss_mb(pid) for pid in pids), 1),
        "threads": threads,
    }
