"""The bridge served as one mahout host: `serve_ring`, behind ``python -m mahout ring --server``.

Claiming, token pushes, completion and failure all go through the normal host API
(`mahout.api.HostApi` driven by `mahout.loop.HostLoop`); the ring is just this host's
engine (`mahout.ring.runner.RingRunner`). It qualifies with a measured run of the ring
itself. A stage dying raises `RingBroken` out of the runner's ``stream``, which the loop
reports as the job's failure; `serve_ring` then stops claiming until the ring is whole again.

The ring serves one catalog model (``--name``, the shipped Gemma 3 270M by default): its file
is the one `mahout add` registered for that name (`mahout.ring.model.ring_model`), or
``--model PATH``, checked against the catalog's pin before the qualifying run; its stages
load that file.

While the owner of the bridge's machine wants it (`mahout.owner`: `mahout pause`,
``--schedule``, the idle detector unless ``--no-idle-detect``), the host loops claim nothing
and finish the jobs in hand, as `mahout run`'s do; the ring stays formed, idle, so work resumes
without reloading. A stage on another host watches its own owner (`mahout.ring.member`).

This module is the one part of the ring above the host loop (like `mahout.moe.serve`): the
rest of `mahout.ring` sits below `mahout.loop` (which runs ring checks, `mahout.ring.checking`).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mahout.link import Heartbeat
from mahout.model_files import SHIPPED_MODEL
from mahout.ring.bridge import RingBridge, RingError
from mahout.ring.model import RingModel, ring_model
from mahout.ring.runner import RingRunner, ring_benchmark
from protocol.timing import RING_CLAIM_WAIT_SECONDS

if TYPE_CHECKING:
    from mahout.api import HostApi
    from mahout.loop import HostLoop

__all__ = ["ring_loops", "run_loops", "serve_ring"]


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
    api: HostApi,
    bridge: RingBridge,
    model_path: str | Path,
    *,
    parallel: int,
    n_ctx: int,
    fingerprint: str,
    home: Path,
    name: str | None = None,
    out: Callable[[str], None] = print,
    **loop_options: Any,
) -> list[HostLoop]:
    """`parallel` host loops sharing one ring, each with its own runner: each claims and
    streams one job at a time through the normal host API, so up to `parallel` requests are
    in flight in the ring together (the gateway lets a host run several jobs at once). They
    claim jobs for catalog model `name` (default: the shipped one)."""
    from mahout.loop import HostLoop

    return [
        HostLoop(
            api,
            {name or SHIPPED_MODEL: RingRunner(bridge, model_path, n_ctx=n_ctx)},
            fingerprint=fingerprint,
            home=home,
            out=out,
            **loop_options,
        )
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


def _qualify(
    bridge: RingBridge,
    model: RingModel,
    api: HostApi,
    args: argparse.Namespace,
    pids: list[int],
    n_stages: int,
    say: Callable[[str], None],
) -> str:
    """Benchmark the ring as it is and register the qualification; returns the fingerprint."""
    from mahout.catalog import checked_file, file_sha256
    from mahout.fingerprint import machine_fingerprint
    from mahout.host import Qualified, register_when_reachable

    sha256 = model.sha256 or file_sha256(model.path)  # the catalog pins the file: the ring must run that very one
    checked_file(model.spec, model.path, sha256)
    runner = RingRunner(bridge, model.path, n_ctx=args.n_ctx)
    result = ring_benchmark(bridge, runner, threads=n_stages * args.threads, pids=pids, gen_tokens=args.bench_tokens)
    say(
        f"mahout: ring benchmark of {model.name}: {result['gen_tps']} tok/s generation, "
        f"{result['prompt_tps']} tok/s prompt, {result['ttft_ms']} ms to first token, {result['memory_mb']} MB"
    )
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
            args.ring = ring_api.propose(
                model=model.name, stages=args.stages, row_width=args.row_width, micro_batch=args.micro_batch
            )["ring"]
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
                loops = ring_loops(
                    api,
                    bridge,
                    model.path,
                    parallel=args.parallel,
                    n_ctx=args.n_ctx,
                    fingerprint=fingerprint,
                    home=owner.home,
                    name=model.name,
                    out=say,
                    claim_wait=RING_CLAIM_WAIT_SECONDS,
                    idle=owner.idle,
                    schedule=owner.schedule,
                )
                say(
                    f"mahout: serving {model.name} from ring {args.ring} ({n_stages} stages) for {args.server} "
                    f"({args.parallel} job(s) at once)"
                )
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
