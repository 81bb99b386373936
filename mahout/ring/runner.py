"""The bridge as one mahout host: a runner whose ``stream(job)`` feeds the ring.

Claiming, token pushes, completion and failure all go through the normal host API
(`mahout.api.HostApi` driven by `mahout.loop.HostLoop`); the ring is just this host's
engine. It qualifies with a measured run of the ring itself. A stage dying raises
`RingBroken` out of ``stream``, which the loop reports as the job's failure.
"""
from __future__ import annotations

import argparse
import contextlib
import resource
import threading
import time
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mahout.prompt import STOP_STRINGS, render_job
from mahout.ring.bridge import RingBridge, RingError, RingRequest

if TYPE_CHECKING:
    from mahout.api import HostApi
    from mahout.loop import HostLoop

__all__ = ["RingRunner", "ring_benchmark", "ring_loops", "run_loops", "serve_ring"]

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
        self._stop_ids = {self._vocab.token_eos()}
        for text in STOP_STRINGS:
            ids = self._vocab.tokenize(text.encode(), add_bos=False, special=True)
            if len(ids) == 1:
                self._stop_ids.add(ids[0])
        self.finish_reason = "stop"
        self.completion_tokens = 0

    def _decode(self, ids: list[int]) -> str:
        return self._vocab.detokenize(ids).decode("utf-8", errors="replace")

    def stream(self, job: dict) -> Generator[str, None, None]:
        params = job.get("params") or {}
        prompt = self._vocab.tokenize(render_job(job).encode("utf-8"), add_bos=True, special=True)
        budget = self.n_ctx - len(prompt)
        if budget <= 0:
            raise ValueError(f"prompt is {len(prompt)} tokens; the ring's context window is {self.n_ctx} tokens")
        max_tokens = min(int(params.get("max_tokens") or budget), budget)
        stops = [s for s in (params.get("stop") or []) if s]
        temperature = params.get("temperature")
        self.finish_reason, self.completion_tokens = "length", 0
        request = self.bridge.submit(
            prompt, max_tokens, stop_ids=sorted(self._stop_ids),
            temperature=1.0 if temperature is None else float(temperature), seed=params.get("seed"),
        )
        try:
            yield from self._pieces(request, stops)
        finally:
            if request.finish_reason is None:  # a stop string, or the loop let go: free the ring's rows
                self.bridge.cancel(request.id)

    def _pieces(self, request: RingRequest, stops: list[str]) -> Generator[str, None, None]:
        ids: list[int] = []
        sent = ""
        for token in request:
            if token in self._stop_ids:
                self.finish_reason = "stop"
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
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
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
    done = threading.Event()

    def report() -> None:
        try:
            api.report_stats(args.ring, bridge.stats())
        except (HostApiError, ServerUnavailable, RingError) as exc:
            say(f"mahout: could not report ring stats: {exc}")

    def every() -> None:
        while not done.wait(args.report_every):
            report()

    thread = threading.Thread(target=every, name="ring-stats", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=5)
        report()
        api.close()


def ring_loops(
    api: HostApi, bridge: RingBridge, model_path: str | Path, *, parallel: int, n_ctx: int, fingerprint: str,
    home: Path, out: Callable[[str], None] = print, **loop_options: Any,
) -> list[HostLoop]:
    """`parallel` host loops sharing one ring, each with its own runner: each claims and
    streams one job at a time through the normal host API, so up to `parallel` requests are
    in flight in the ring together (the gateway lets a host run several jobs at once)."""
    from mahout.loop import HostLoop
    from mahout.models import SHIPPED_MODEL

    return [
        HostLoop(api, {SHIPPED_MODEL: RingRunner(bridge, model_path, n_ctx=n_ctx)}, fingerprint=fingerprint, home=home,
                 out=out, **loop_options)
        for _ in range(parallel)
    ]


def run_loops(loops: list[HostLoop], *, max_jobs: int | None = None) -> int:
    """Run the loops together (the first in this thread, so it owns the signal handlers)
    until ``max_jobs`` jobs were handled in all or one of them is stopped; the others then
    finish their current job (or long-poll) and stop. Returns the jobs handled."""
    lock = threading.Lock()
    handled = [0]

    def stop_all() -> None:
        for loop in loops:
            loop.request_stop()

    def drive(loop: HostLoop) -> None:
        while True:
            done = loop.run(max_jobs=1)  # returns after one job, or 0 once stopped
            with lock:
                handled[0] += done
                finished = not done or (max_jobs is not None and handled[0] >= max_jobs)
            if finished:
                stop_all()
                return

    threads = [threading.Thread(target=drive, args=(loop,), name="ring-loop", daemon=True) for loop in loops[1:]]
    for thread in threads:
        thread.start()
    try:
        drive(loops[0])
    finally:
        stop_all()
        for thread in threads:
            thread.join()
    return handled[0]


def serve_ring(ring, model_path: str | Path, args: argparse.Namespace, *, say: Callable[[str], None] = print) -> int:  # type: ignore[no-untyped-def]
    """Qualify the ring with the gateway and serve jobs through the normal host loop."""
    from mahout.api import HostApi
    from mahout.fingerprint import machine_fingerprint
    from mahout.home import resolve_home
    from mahout.host import Qualified, register_when_reachable
    from mahout.models import SHIPPED_MODEL

    runner = RingRunner(ring.bridge, model_path, n_ctx=args.n_ctx)
    pids = [proc.pid for proc in getattr(ring, "procs", [])]
    result = ring_benchmark(ring.bridge, runner, threads=args.stages * args.threads, pids=pids)
    say(f"mahout: ring benchmark of {SHIPPED_MODEL}: {result['gen_tps']} tok/s generation, "
        f"{result['prompt_tps']} tok/s prompt, {result['ttft_ms']} ms to first token, {result['memory_mb']} MB")
    fingerprint, facts = machine_fingerprint()
    api = HostApi(args.server, args.token)
    try:
        register_when_reachable(api, Qualified(Path(model_path), "", result, fingerprint, facts), out=say)
        loops = ring_loops(api, ring.bridge, model_path, parallel=args.parallel, n_ctx=args.n_ctx,
                           fingerprint=fingerprint, home=resolve_home(args.home), out=say)
        say(f"mahout: serving {SHIPPED_MODEL} from a ring of {args.stages} stages for {args.server} "
            f"({args.parallel} job(s) at once)")
        with _reporting(ring.bridge, args, say):
            handled = run_loops(loops, max_jobs=args.max_jobs)
    finally:
        api.close()
    say(f"mahout: stopped after {handled} job(s)")
    return 0
