"""Starting a host: assemble the model, benchmark it (or reuse the cache), qualify, loop.

Kept apart from :mod:`mahout.loop` so the loop can be tested with fake runners and no
model, while this module wires the real pieces together for ``python -m mahout run``.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mahout.api import HostApi, ServerUnavailable
from mahout.benchmark import qualify
from mahout.fingerprint import machine_fingerprint
from mahout.idle import IdleDetector
from mahout.loop import HostLoop
from mahout.models import SHIPPED_MODEL, assemble_shipped, recorded_sha256

RUNNER_N_CTX = 4096
UNREACHABLE_RETRY_S = 5.0


def default_threads() -> int:
    """Half the CPUs this process may run on (at least 1), as llama-cpp-python defaults.

    Logical CPUs are usually two per physical core, and llama.cpp gains nothing from SMT;
    more threads than free cores makes its OpenMP workers spin against each other, the
    gateway and the owner's programs (measured here: 60 tokens took 13 s with 2 threads on
    a busy 2-CPU machine, 3 s with 1).
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, cpus // 2)


@dataclass(frozen=True)
class Qualified:
    """The shipped model assembled and benchmarked on this machine."""

    path: Path
    sha256: str
    benchmark: dict
    fingerprint: str
    machine: dict


def benchmark_shipped(
    home: Path, threads: int, *, rebenchmark: bool = False, out: Callable[[str], None] = print,
) -> Qualified:
    """Assemble the shipped model and benchmark it (or reuse the cached result)."""
    path = assemble_shipped(home)
    sha256 = recorded_sha256(home) or ""
    fingerprint, facts = machine_fingerprint()
    result, cached = qualify(home, SHIPPED_MODEL, path, sha256, fingerprint, threads, rebenchmark=rebenchmark)
    out(f"mahout: benchmark of {SHIPPED_MODEL} ({'cached' if cached else 'measured'}): "
        f"{result['gen_tps']} tok/s generation, {result['prompt_tps']} tok/s prompt, "
        f"{result['ttft_ms']} ms to first token, {result['memory_mb']} MB")
    return Qualified(path, sha256, result, fingerprint, facts)


def register_when_reachable(
    api: HostApi, model: Qualified, *, out: Callable[[str], None] = print,
    retry_s: float = UNREACHABLE_RETRY_S, sleep: Callable[[float], None] = time.sleep,
) -> dict:
    """Register the qualification, waiting for a gateway that is not up yet.

    A host may start before its gateway (``make run``, a reboot); it waits rather than
    exits. A refusal (4xx: bad token, unknown model) still raises at once.
    """
    while True:
        try:
            return api.register_qualification(
                model=SHIPPED_MODEL, fingerprint=model.fingerprint, benchmark=model.benchmark, machine=model.machine
            )
        except ServerUnavailable as exc:
            problem = str(exc)
        out(f"mahout: server unavailable ({problem}); retrying in {retry_s:.0f} s")
        sleep(retry_s)


def start_host(
    api: HostApi, home: Path, threads: int, *, idle: IdleDetector | None = None,
    rebenchmark: bool = False, out: Callable[[str], None] = print,
) -> HostLoop:
    """Qualify the shipped model with the server and return a loop ready to :meth:`run`."""
    from mahout.runners.llama import LlamaRunner

    model = benchmark_shipped(home, threads, rebenchmark=rebenchmark, out=out)
    register_when_reachable(api, model, out=out)
    out(f"mahout: qualified {SHIPPED_MODEL} on machine {model.fingerprint[:12]}")
    runner = LlamaRunner(model.path, threads, n_ctx=RUNNER_N_CTX)
    return HostLoop(api, {SHIPPED_MODEL: runner}, fingerprint=model.fingerprint, home=home, idle=idle, out=out)
