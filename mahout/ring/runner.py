"""The bridge as one mahout host: a runner whose ``stream(job)`` feeds the ring.

Claiming, token pushes, completion and failure all go through the normal host API
(`mahout.api.HostApi` driven by `mahout.loop.HostLoop`); the ring is just this host's
engine. It qualifies with a measured run of the ring itself. A stage dying raises
`RingBroken` out of ``stream``, which the loop reports as the job's failure; `serve_ring`
then stops claiming until the ring is whole again.

The ring serves one catalog model (``--name``, the shipped Gemma 3 270M by default): its file
is the one `mahout add` registered for that name (`mahout.ring.model.ring_model`), or
``--model PATH``, checked against the catalog's pin before the qualifying run; its stages
load that file, and the runner counts and detokenises with that file's own vocabulary (the
gateway renders the prompt with the entry's template and sends the fragments).

While the owner of the bridge's machine wants it (`mahout.owner`: `mahout pause`,
``--schedule``, the idle detector unless ``--no-idle-detect``), the host loops claim nothing
and finish the jobs in hand, as `mahout run`'s do; the ring stays formed, idle, so work resumes
without reloading. A stage on another host watches its own owner (`mahout.ring.member`).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mahout.link import Heartbeat
from mahout.ring.bridge import RingBridge, RingError, RingRequest
from mahout.ring.membership import GRAMMAR_MAX_BYTES
from mahout.ring.model import RingModel, ring_model
from mahout.runners import Piece, RequestRejected
from mahout.runners.llama import (
    PromptTokenizer,
    Vocab,
    count_tokens,
    end_of_generation_ids,
    grammar_for,
    healing,
    pieces_whole,
    resumes_text,
    rewrite_budget,
)
from mahout.runners.logprobs import LogprobRecorder, Step, TokenAligner

if TYPE_CHECKING:
    from mahout.api import HostApi
    from mahout.loop import HostLoop

__all__ = ["RingRunner", "ring_benchmark", "ring_loops", "run_loops", "serve_ring"]

# Ring loops long-poll briefly: once the ring breaks they must stop claiming before the
# gateway offers this host the continuation of the job that just failed here (it skips the
# failed host for CONTINUATION_GRACE_SECONDS, 2 s by default).
RING_CLAIM_WAIT_S = 1.5

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
        if rewrite or resumes_text(job):  # written again first (its cut last word, or a rewrite), as a single-machine host does
            prompt, healer = healing(job, prompt, self._heal_vocab())
            if healer is not None and 2 * len(healer.dropped) > GRAMMAR_MAX_BYTES:  # (sent as hex ahead of the rows)
                raise RequestRejected(f"the text to write again is over the {GRAMMAR_MAX_BYTES // 2} bytes a ring carries")
        stops = [s for s in (params.get("stop") or []) if s]
        self._stop_ids = {*self._ends, *self._prompt.single_ids(job.get("end_of_turn") or [])}
        temperature, logprobs = params.get("temperature"), params.get("logprobs")
        self.finish_reason, self.completion_tokens = "length", 0
        self.token_ids, self.seed = [], params.get("seed")
        request = self.bridge.submit(
            prompt, max_tokens, stop_ids=sorted(self._stop_ids),
            temperature=1.0 if temperature is None else float(temperature),
            top_p=1.0 if params.get("top_p") is None else float(params["top_p"]), seed=params.get("seed"),
            logprobs=None if logprobs is None else int(logprobs),
            grammar=None if grammar is None else grammar._grammar,  # type: ignore[attr-defined]
            grammar_root="root" if grammar is None else grammar._root,  # type: ignore[attr-defined]
            request_id=f"job-{job.get('id')}-{uuid.uuid4().hex[:8]}",  # stages keep evidence under it (`mahout.ring.evidence`)
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
            self.completion_tokens = self._count(self._decode(self.token_ids[:self.completion_tokens]).removeprefix(rewrite))

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
            for entry in request.logprobs[len(recorder.steps):len(self.token_ids)]:
                entry = entry or {"logprob": 0.0, "top": []}  # (a tail that sent none: an audit compares them)
                recorder.steps.append(Step(top=[(int(t), float(lp)) for t, lp in entry["top"]], logprobs=None,
                                           token=self.token_ids[len(recorder.steps)], logprob=float(entry["logprob"])))

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
                    yield text[len(sent):cut]
                self.completion_tokens = len(ids)
                return
            if text.endswith("\ufffd"):  # half a UTF-8 character: wait for the rest
                continue
            if len(text) > len(sent):
                yield text[len(sent):]
                sent = text
        text = self._decode(ids)
        if len(text) > len(sent):
            yield text[len(sent):]
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


def ring_benchmark(bridge: RingBridge, runner: RingRunner, *, threads: int, pids: list[int], gen_tokens: int = 32) -> dict:
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


@contextlib.contextmanager
def _reporting(bridge: RingBridge, args: argparse.Namespace, say: Callable[[str], None]) -> Iterator[None]:
    """With ``--ring ID``: report the stages' time use to the gateway every ``--report-every``
    seconds and once at the end (a failed report is printed, never fatal)."""
    if args.ring is None:
        yield
        return
    from mahout.api import HostApiError, ServerUnavailable
    from mahout.ring.api import RingApi

    api = RingApi(args.server, args.token, retries=1)

    def report() -> None:
        try:
            api.report_stats(args.ring, bridge.stats())
        except (HostApiError, ServerUnavailable, RingError) as exc:
            say(f"mahout: could not report ring stats: {exc}")

    heartbeat = Heartbeat(report, args.report_every, name="ring-stats", at_once=False).start()
    try:
        yield
    finally:
        heartbeat.stop(timeout=5)
        report()
        api.close()


def ring_loops(
    api: HostApi, bridge: RingBridge, model_path: str | Path, *, parallel: int, n_ctx: int, fingerprint: str,
    home: Path, name: str | None = None, out: Callable[[str], None] = print, **loop_options: Any,
) -> list[HostLoop]:
    """`parallel` host loops sharing one ring, each with its own runner: each claims and
    streams one job at a time through the normal host API, so up to `parallel` requests are
    in flight in the ring together (the gateway lets a host run several jobs at once). They
    claim jobs for catalog model `name` (default: the shipped one)."""
    from mahout.loop import HostLoop
    from mahout.model_files import SHIPPED_MODEL

    return [
        HostLoop(api, {name or SHIPPED_MODEL: RingRunner(bridge, model_path, n_ctx=n_ctx)}, fingerprint=fingerprint,
                 home=home, out=out, **loop_options)
        for _ in range(parallel)
    ]


def run_loops(loops: list[HostLoop], *, max_jobs: int | None = None, until: threading.Event | None = None) -> int:
    """Run the loops together (the first in this thread, so it owns the signal handlers)
    until ``max_jobs`` jobs were handled in all, one of them is stopped, or ``until`` is set
    (the ring broke); the others then finish their current job (or short long-poll) and
    stop. Returns the jobs handled."""
    lock = threading.Lock()
    handled = [0]
    finished = threading.Event()

    def stop_all() -> None:
        for loop in loops:
            loop.request_stop()

    def drive(loop: HostLoop) -> None:
        while True:
            done = loop.run(max_jobs=1)  # returns after one job, or 0 once stopped
            with lock:
                handled[0] += done
                over = not done or (max_jobs is not None and handled[0] >= max_jobs)
            if over:
                stop_all()
                return

    def watch() -> None:
        assert until is not None
        while not finished.is_set():
            if until.wait(0.1):
                stop_all()
                return

    threads = [threading.Thread(target=drive, args=(loop,), name="ring-loop", daemon=True) for loop in loops[1:]]
    if until is not None:
        threads.append(threading.Thread(target=watch, name="ring-watch", daemon=True))
    for thread in threads:
        thread.start()
    try:
        drive(loops[0])
    finally:
        stop_all()
        finished.set()
        for thread in threads:
            thread.join()
    return handled[0]


def _qualify(bridge: RingBridge, model: RingModel, api: HostApi, args: argparse.Namespace, pids: list[int],
             n_stages: int, say: Callable[[str], None]) -> str:
    """Benchmark the ring as it is and register the qualification; returns the fingerprint."""
    from mahout.catalog import checked_file, file_sha256
    from mahout.fingerprint import machine_fingerprint
    from mahout.host import Qualified, register_when_reachable

    sha256 = model.sha256 or file_sha256(model.path)  # the catalog pins the file: the ring must run that very one
    checked_file(model.spec, model.path, sha256)
    runner = RingRunner(bridge, model.path, n_ctx=args.n_ctx)
    result = ring_benchmark(bridge, runner, threads=n_stages * args.threads, pids=pids, gen_tokens=args.bench_tokens)
    say(f"mahout: ring benchmark of {model.name}: {result['gen_tps']} tok/s generation, "
        f"{result['prompt_tps']} tok/s prompt, {result['ttft_ms']} ms to first token, {result['memory_mb']} MB")
    fingerprint, facts = machine_fingerprint()
    register_when_reachable(api, Qualified(model.path, sha256, result, fingerprint, facts, model.name), out=say)
    return fingerprint


def serve_ring(args: argparse.Namespace, *, say: Callable[[str], None] = print) -> int:
    """Serve the marketplace from a ring found through the control plane.

    The ring is ``--ring ID`` (an operator's plan) or, with ``--stages N``, this host's own
    ring of N stages (proposed to the gateway, reused on restart). The stages the plan gives
    this host run here as ``mahout stage`` processes; the others run on their hosts. The
    bridge reads its two links' secrets and the head's and the tail's addresses from the gateway,
    dials them (each link passes its handshake with its own secret), qualifies
    the ring once, and claims jobs through the normal host loop. When the ring breaks the
    open jobs fail (the gateway continues or ends them honestly), claiming stops, local
    stages that died are restarted, and the bridge waits for every stage to report again.
    """
    from mahout.api import HostApi
    from mahout.catalog import ModelUnavailable
    from mahout.home import resolve_home
    from mahout.owner import owner_guard
    from mahout.presence import presence
    from mahout.ring.api import RingApi
    from mahout.ring.member import LocalStages, exit_on_sigterm
    from mahout.ring.rendezvous import RendezvousTimeout, bridge_connect

    home = resolve_home(args.home)
    try:
        model = ring_model(args.name, home, args.model)
    except ModelUnavailable as exc:
        say(f"mahout: error: {exc}")
        return 2
    args.model = str(model.path)  # the local stages load the very file the bridge checked
    owner = owner_guard(args, home)
    api, ring_api = HostApi(args.server, args.token), RingApi(args.server, args.token)
    local: LocalStages | None = None
    handled, fingerprint = 0, ""
    previous = exit_on_sigterm()  # between sessions too, so that the local stages are stopped
    try:
        if args.ring is None:
            args.ring = ring_api.propose(model=model.name, stages=args.stages, row_width=args.row_width,
                                         micro_batch=args.micro_batch)["ring"]
        n_stages = len(ring_api.addresses(args.ring))
        keys = ring_api.bridge_keys(args.ring)
        mine = sorted(a["stage"] for a in ring_api.assignment() if a["ring"] == args.ring)
        bind_host = args.bind or ("127.0.0.1" if len(mine) == n_stages else "0.0.0.0")
        local = LocalStages(args, args.ring, mine, bind_host=bind_host, say=say)
        say(f"mahout: ring {args.ring}: {n_stages} stages; here: {mine or 'none'}; the others run on their hosts")
        with presence(args.server, args.token, out=say):
            while True:
                try:
                    bridge = bridge_connect(ring_api, args.ring, n_stages, keys=keys, timeout=args.wait, say=say)
                except RendezvousTimeout as exc:
                    say(f"mahout: error: {exc}")
                    return 1
                if not fingerprint:
                    fingerprint = _qualify(bridge, model, api, args, local.pids, n_stages, say)
                loops = ring_loops(api, bridge, model.path, parallel=args.parallel, n_ctx=args.n_ctx,
                                   fingerprint=fingerprint, home=owner.home, name=model.name, out=say,
                                   claim_wait=RING_CLAIM_WAIT_S, idle=owner.idle, schedule=owner.schedule)
                say(f"mahout: serving {model.name} from ring {args.ring} ({n_stages} stages) for {args.server} "
                    f"({args.parallel} job(s) at once)")
                left = None if args.max_jobs is None else args.max_jobs - handled
                with _reporting(bridge, args, say):
                    handled += run_loops(loops, max_jobs=left, until=bridge.down)
                broken = bridge.broken
                bridge.close()
                if broken is None or (args.max_jobs is not None and handled >= args.max_jobs):
                    break
                say(f"mahout: {broken}; stopped claiming, waiting for the stages to rejoin")
                local.revive()
    finally:
        if local is not None:
            local.close()
        api.close()
        ring_api.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    say(f"mahout: stopped after {handled} job(s)")
    return 0
