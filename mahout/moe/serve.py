"""The MoE coordinator as a marketplace host: `python -m mahout moe coordinator`.

It benchmarks the MoE model on this machine and qualifies it with the gateway
(`POST /hosts/api/qualifications`, through `mahout.host.qualify_with_server`, with the
benchmark cached by `mahout.benchmark.qualify`), then claims jobs for it through the normal
host loop (`mahout.loop.HostLoop`): one loop per inference slot, all sharing one
`MoeRunner`, so several requests are in flight at once and the runner's self-probe sees
them as busy slots. A `CoordinatorAgent` reports that load to the expert market and applies
the dispatch map it answers with. Tokens stream back, jobs complete or fail, and the
presence socket is held, exactly as for any host: billing and failover are the gateway's.

The model must be in the gateway's catalog under the name given here (an operator runs
`python manage.py moe_register PATH --name NAME`).
"""

from __future__ import annotations

import functools
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mahout.api import HostApi
from mahout.benchmark import qualify, rss_mb
from mahout.catalog import file_sha256
from mahout.fingerprint import machine_fingerprint
from mahout.host import Qualified, qualify_with_server
from mahout.loop import HostLoop
from mahout.moe.runner import MoeRunner
from mahout.owner import OwnerGuard
from protocol.timing import CLAIM_WAIT_SECONDS, MOE_COORDINATOR_REPORT_SECONDS

if TYPE_CHECKING:
    import torch

__all__ = ["MoeHostLoop", "coordinator_runner", "measure_moe", "serve_coordinator"]

BENCH_PROMPT = "The history of the elephant is long and varied. Elephants live in families. "
BENCH_TOKENS = 16


def coordinator_runner(
    path: Path, *, slots: int, device: torch.device | None = None, n_ctx: int | None = None
) -> MoeRunner:
    """The coordinator's runner, its model on `device` (default: the CPU; `mahout.moe.device`),
    each slot's KV cache sized for `n_ctx` tokens (default: the model's whole context)."""
    runner = MoeRunner(path, n_slots=slots, n_ctx=n_ctx)
    if device is not None:
        from mahout.moe.device import on_device

        runner.model = on_device(runner.model, device)  # type: ignore[assignment]  # called and cached as the model is
    return runner


def measure_moe(
    path: Path, threads: int, *, progress: bool = True, device: torch.device | None = None, n_ctx: int | None = None
) -> dict:
    """The qualification figures of the MoE model on this machine (on `device`), all experts
    local: prompt tokens/s (one prefill), time to first token, generation tokens/s, memory."""
    import torch

    torch.set_num_threads(threads)
    before = rss_mb()
    runner = coordinator_runner(path, slots=1, device=device, n_ctx=n_ctx)
    try:
        prompt = runner.tokenizer.encode(BENCH_PROMPT)
        started = time.perf_counter()
        first = end = started
        produced = 0
        for _ in runner.generate_stream(prompt, BENCH_TOKENS):
            produced += 1
            end = time.perf_counter()
            if produced == 1:
                first = end
        ttft = first - started
        return {
            "prompt_tps": round(len(prompt) / max(ttft, 1e-9), 1),
            "gen_tps": round((produced - 1) / max(end - first, 1e-9), 1),
            "ttft_ms": round(ttft * 1000, 1),
            "memory_mb": round(max(rss_mb() - before, 0.0), 1),
            "threads": threads,
        }
    finally:
        runner.close()


class MoeHostLoop(HostLoop):
    """A host loop for one slot of a shared runner; its heartbeat's catalog tells the gateway
    how many slots the coordinator has and how many are busy, so routing offers it that many
    jobs at once."""

    def __init__(
        self, api: HostApi, models: dict[str, Any], *, slots: int, busy: Callable[[], int], **kwargs: Any
    ) -> None:
        super().__init__(api, models, **kwargs)  # (this loop runs one job at a time: its own slot)
        self.coordinator_slots, self.busy = slots, busy

    def catalog(self) -> dict:
        return {**super().catalog(), "slots": self.coordinator_slots, "active_jobs": self.busy()}


def serve_coordinator(
    *,
    server: str,
    token: str,
    model_path: Path,
    name: str,
    home: Path,
    slots: int = 4,
    threads: int = 1,
    agent_interval_s: float = MOE_COORDINATOR_REPORT_SECONDS,
    claim_wait: float = CLAIM_WAIT_SECONDS,
    rebenchmark: bool = False,
    owner: OwnerGuard | None = None,
    device: torch.device | None = None,
    n_ctx: int | None = None,
    out: Callable[[str], None] = print,
) -> int:
    """Qualify, then serve `name` until SIGTERM/SIGINT (the first finishes the running jobs and
    lets each slot's long-poll end, within `claim_wait`; the second exits at once); returns
    the number of jobs handled. Each slot asks `owner` (default: the pause flag of `home`
    only) before every claim, as `mahout run` does, and finishes the job it holds. The model
    runs on `device` (default: the CPU), benchmark included, with `n_ctx` tokens of context per
    slot (default: the model's whole context; a longer prompt is refused with the reason)."""
    import torch

    from mahout.moe.control import CoordinatorAgent, MeshClient
    from mahout.presence import presence

    torch.set_num_threads(threads)
    home.mkdir(parents=True, exist_ok=True)
    sha256 = file_sha256(model_path)
    fingerprint, facts = machine_fingerprint()
    result, cached = qualify(
        home,
        name,
        model_path,
        sha256,
        fingerprint,
        threads,
        rebenchmark=rebenchmark,
        measure=functools.partial(measure_moe, device=device, n_ctx=n_ctx),
    )
    out(
        f"mahout moe: benchmark of {name} ({'cached' if cached else 'measured'}): {result['gen_tps']} tok/s "
        f"generation, {result['ttft_ms']} ms to first token"
    )
    api = HostApi(server, token)
    try:
        qualify_with_server(api, [Qualified(model_path, sha256, result, fingerprint, facts, name)], out=out)
    finally:
        api.close()
    runner = coordinator_runner(model_path, slots=slots, device=device, n_ctx=n_ctx).start()
    out(
        f"mahout moe: KV cache {runner.kv_cache_mib():.0f} MiB: "
        f"{slots} slots × {runner.model.cache.n_ctx} tokens of context"
        + ("" if n_ctx else " (the model's whole context; --ctx caps it)")
    )
    client = MeshClient(server, token)
    agent = CoordinatorAgent(runner, client, name, interval_s=agent_interval_s).start()
    owner = owner or OwnerGuard(home)
    loops = [
        MoeHostLoop(
            HostApi(server, token),
            {name: runner.slot()},
            fingerprint=fingerprint,
            home=owner.home,
            installed=[name],
            slots=slots,
            busy=runner.busy_slots,
            claim_wait=claim_wait,
            idle=owner.idle,
            schedule=owner.schedule,
            out=out,
        )
        for _ in range(slots)
    ]
    try:
        with presence(server, token, out=out):
            out(f"mahout moe: coordinating {name} with {slots} slots for {server}")
            return _run_loops(loops, out=out)
    finally:
        agent.stop()
        runner.close()
        client.close()
        for loop in loops:
            loop.api.close()


def _run_loops(loops: Sequence[HostLoop], *, out: Callable[[str], None]) -> int:
    """Each loop on its own thread; signals are taken here, in the main thread."""
    handled: list[int] = []
    signals = [0]

    def on_signal(signum: int, _frame: object) -> None:
        signals[0] += 1
        if signals[0] > 1:
            out("mahout moe: second signal, exiting now")
            raise SystemExit(1)
        for loop in loops:
            loop.request_stop()
        if all(loop.waiting_for_work for loop in loops):  # no job running: nothing to finish
            out(f"mahout moe: {signal.Signals(signum).name} received while waiting for work, exiting")
            raise SystemExit(0)
        out(f"mahout moe: {signal.Signals(signum).name} received, finishing the running jobs then exiting")

    threads = [
        threading.Thread(target=lambda loop=loop: handled.append(loop.run()), name=f"moe-slot-{i}", daemon=True)
        for i, loop in enumerate(loops)
    ]
    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)} if main else {}
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():
                thread.join(0.5)  # a timed join lets the main thread take signals
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return sum(handled)
