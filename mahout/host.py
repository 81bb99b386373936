"""Starting a host: for each chosen model, find it, benchmark it (or reuse the cache) and
qualify it; then load what fits in the memory budget and return the loop.

Kept apart from :mod:`mahout.loop` so the loop can be tested with fake runners and no
model, while this module wires the real pieces together for ``python -m mahout run``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mahout.api import HostApi, HostApiError, ServerUnavailable
from mahout.benchmark import qualify, store_cached
from mahout.catalog import CATALOG, DEFAULT_MODELS, ModelSpec, checked_file, installed_models, model_spec
from mahout.fingerprint import machine_fingerprint, total_memory_mb
from mahout.gpu import AUTO, Gpu, Offload, plan_offload
from mahout.idle import IdleDetector
from mahout.loader import ModelLoader, check_fits
from mahout.loop import HostLoop
from mahout.model_files import SHIPPED_MODEL

UNREACHABLE_RETRY_SECONDS = 5.0


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


def default_budget_mb() -> int:
    """Half of this machine's memory: the owner keeps the other half (at least 1 MB)."""
    return max(1, total_memory_mb() // 2)


@dataclass(frozen=True)
class Qualified:
    """A model found and benchmarked on this machine."""

    path: Path
    sha256: str
    benchmark: dict
    fingerprint: str
    machine: dict
    model: str = SHIPPED_MODEL
    offload: Offload | None = None  # its layers on the GPU, when any
    weights_mb: float = 0.0  # its weights held in memory (not on the GPU), from its file's size

    @property
    def footprint_mb(self) -> float:
        """The memory the loading policy accounts for this model: its measured ``memory_mb``,
        never less than its file's weights that stay in memory (a benchmark cached on a lightly
        loaded machine, or pages of the file not yet read, must not make a big model look small)."""
        return max(float(self.benchmark.get("memory_mb") or 0.0), self.weights_mb)

    @property
    def vram_mb(self) -> float:
        """The GPU memory its weights take (0 on the CPU)."""
        return float(self.benchmark.get("vram_mb") or 0.0)


@dataclass(frozen=True)
class GpuSetup:
    """This machine's GPU as the host uses it: what `--gpu-layers` asked, the GPU found, and
    whether llama.cpp can offload to it."""

    requested: str | int = AUTO
    gpu: Gpu | None = None
    supported: bool = False

    @property
    def active(self) -> bool:
        return self.gpu is not None and self.supported and self.requested != 0


def gpu_setup(requested: str | int = AUTO, *, out: Callable[[str], None] = print) -> GpuSetup:
    """Find the GPU once at start and say what will be used (or why not, and the fix)."""
    from mahout.gpu import gpus_present, llama_backends, offload_supported, startup_report

    gpus, supported = gpus_present(), offload_supported()
    for line in startup_report(gpus, supported, llama_backends()):
        out(line)
    return GpuSetup(requested, gpus[0] if gpus else None, supported)


def offload_for(spec: ModelSpec, path: Path, gpu: GpuSetup | None) -> Offload | None:
    """How much of this model goes on the GPU (None: no GPU in use, or a model that runs on the CPU)."""
    if gpu is None or not gpu.active or not spec.offloads:
        return None
    from mahout.gpu import model_layers

    return plan_offload(
        gpu.requested,
        gpu=gpu.gpu,
        supported=gpu.supported,
        model_mb=path.stat().st_size / 2**20,
        n_layers=model_layers(path),
    )


def weights_mb(spec: ModelSpec, path: Path, offload: Offload | None) -> float:
    """MiB of a GGUF model's weights that stay in memory: its file's size less the part planned
    on the GPU (0 for a model that is not one file)."""
    if spec.kind != "chat" or not path.is_file():
        return 0.0
    return max(path.stat().st_size / 2**20 - (offload.vram_mb if offload else 0.0), 0.0)


def describe(spec: ModelSpec, result: dict) -> str:
    """A benchmark result as one readable phrase."""
    if spec.kind == "embeddings":
        return (
            f"{result['prompt_tps']} tok/s embedded ({result.get('inputs_per_s', '?')} inputs/s), "
            f"{result['ttft_ms']} ms for one input, {result['memory_mb']} MB"
        )
    where = ""
    if result.get("gpu_layers"):
        where = (
            f", {result['gpu_layers']} layers on {result.get('device')} "
            f"(~{result.get('vram_mb', 0):.0f} MB of GPU memory)"
        )
    return (
        f"{result['gen_tps']} tok/s generation, {result['prompt_tps']} tok/s prompt, "
        f"{result['ttft_ms']} ms to first token, {result['memory_mb']} MB{where}"
    )


def benchmark_model(
    name: str,
    home: Path,
    threads: int,
    *,
    rebenchmark: bool = False,
    out: Callable[[str], None] = print,
    gpu: GpuSetup | None = None,
    budget_mb: int | None = None,
) -> Qualified:
    """Find model ``name`` (shipped, or a catalog model whose file the owner added) and
    benchmark it on this machine (or reuse the cached result), with as many of its layers on
    the GPU as `gpu` plans. With `budget_mb`, a model whose file alone cannot fit in it raises
    BudgetError before anything is loaded."""
    spec = model_spec(name, home, CATALOG)
    path, sha256 = spec.locate(home)
    checked_file(spec, path, sha256)
    fingerprint, facts = machine_fingerprint()
    offload = offload_for(spec, path, gpu)
    weights = weights_mb(spec, path, offload)
    if budget_mb is not None:
        check_fits({name: weights}, budget_mb)
    result, cached = qualify(
        home, name, path, sha256, fingerprint, threads, rebenchmark=rebenchmark, measure=spec.measure, offload=offload
    )
    out(f"mahout: benchmark of {name} ({'cached' if cached else 'measured'}): {describe(spec, result)}")
    return Qualified(path, sha256, result, fingerprint, facts, name, offload, weights)


def benchmark_shipped(
    home: Path,
    threads: int,
    *,
    rebenchmark: bool = False,
    out: Callable[[str], None] = print,
) -> Qualified:
    """Assemble the shipped chat model and benchmark it (or reuse the cached result)."""
    return benchmark_model(SHIPPED_MODEL, home, threads, rebenchmark=rebenchmark, out=out)


def register_when_reachable(
    api: HostApi,
    model: Qualified,
    *,
    out: Callable[[str], None] = print,
    retry_s: float = UNREACHABLE_RETRY_SECONDS,
    sleep: Callable[[float], None] = time.sleep,
) -> dict:
    """Register the qualification, waiting for a gateway that is not up yet.

    A host may start before its gateway (``make run``, a reboot); it waits rather than
    exits. A refusal (4xx: bad token, unknown model) still raises at once.
    """
    while True:
        try:
            return api.register_qualification(
                model=model.model,
                fingerprint=model.fingerprint,
                benchmark=model.benchmark,
                machine=model.machine,
                sha256=model.sha256,
            )
        except ServerUnavailable as exc:
            problem = str(exc)
        out(f"mahout: server unavailable ({problem}); retrying in {retry_s:.0f} s")
        sleep(retry_s)


def qualify_with_server(
    api: HostApi,
    models: list[Qualified],
    *,
    out: Callable[[str], None] = print,
) -> list[Qualified]:
    """Register each benchmark; return the models the server accepted.

    A model the gateway does not list (404 ``model_not_found``) is skipped with a line,
    so one unknown model does not stop a host serving the others; if none is accepted,
    the last refusal is raised.
    """
    accepted: list[Qualified] = []
    refusal: HostApiError | None = None
    for model in models:
        try:
            register_when_reachable(api, model, out=out)
        except HostApiError as exc:
            if exc.code != "model_not_found":
                raise
            refusal = exc
            out(f"mahout: the gateway does not list {model.model}; not serving it ({exc.message})")
            continue
        out(f"mahout: qualified {model.model} on machine {model.fingerprint[:12]}")
        accepted.append(model)
    if not accepted and refusal is not None:
        raise refusal
    return accepted


def slots_for(
    model: Qualified,
    home: Path,
    threads: int,
    *,
    requested: int | None = None,
    budget_mb: int | None = None,
    out: Callable[[str], None] = print,
) -> int:
    """How many jobs ``model`` serves at once from its one load: ``requested`` (``--slots``),
    else the number its benchmark chose on this machine (`mahout.runners.batched.slots_chosen`:
    aggregate tokens/s measured at 1, 2, 4 and 8 sequences, cached with the benchmark), fewer
    where the model and that many sequences' KV cache would not fit `budget_mb`. An
    embeddings model takes `mahout.runners.embeddings.SLOTS` jobs at once (their texts share
    forward passes) unless told otherwise."""
    if requested is not None:
        return requested
    if model_spec(model.model, home, CATALOG).kind != "chat":
        from mahout.runners.embeddings import SLOTS

        return SLOTS
    chosen = model.benchmark.get("slots")
    if not (isinstance(chosen, int) and not isinstance(chosen, bool) and chosen >= 1):
        from mahout.runners.batched import slots_chosen, slots_measured

        out(f"mahout: measuring how many jobs {model.model} serves at once on this machine (1, 2, 4, 8 streams)")
        measured = slots_measured(model.path, threads, gpu_layers=model.offload.layers if model.offload else 0)
        chosen = slots_chosen(measured)
        store_cached(
            home,
            model.model,
            model.fingerprint,
            model.sha256,
            {
                **model.benchmark,
                "slots": chosen,
                "slots_tps": {str(count): round(tps, 1) for count, tps in measured.items()},
            },
        )
        rates = ", ".join(f"{tps:.0f} at {count}" for count, tps in measured.items())
        out(f"mahout: {model.model} serves {chosen} job(s) at once (aggregate tok/s {rates}; --slots overrides)")
    per_sequence = kv_mb(model) if budget_mb is not None else 0.0
    if per_sequence > 0 and budget_mb is not None:
        fits = max(1, min(chosen, int((budget_mb - model.footprint_mb) // per_sequence)))
        if fits < chosen:
            out(
                f"mahout: {model.model} serves {fits} job(s) at once, not {chosen}: the KV cache of {chosen} "
                f"(~{chosen * per_sequence:.0f} MB) does not fit its memory budget of {budget_mb} MB"
            )
            chosen = fits
    return chosen


def kv_mb(model: Qualified) -> float:
    """The KV cache one more sequence of a chat model's context takes (MB; `mahout.gpu`)."""
    from mahout.catalog import RUNNER_N_CTX
    from mahout.gpu import kv_mb_per_sequence

    return kv_mb_per_sequence(model.path, RUNNER_N_CTX) if model.path.is_file() else 0.0


def start_host(
    api: HostApi,
    home: Path,
    threads: int,
    *,
    models: list[str] | tuple[str, ...] = DEFAULT_MODELS,
    memory_budget_mb: int | None = None,
    idle: IdleDetector | None = None,
    rebenchmark: bool = False,
    out: Callable[[str], None] = print,
    gpu: GpuSetup | None = None,
    slots: int | None = None,
) -> HostLoop:
    """Qualify ``models`` with the server, load what fits in the budget (in the order
    given), and return a loop ready to :meth:`run`; the rest load when a job needs them.
    Each chat model serves ``slots`` jobs at once (None: as many as its benchmark chose); the
    host claims as many as the least of its models takes at once, so any job it claims starts.

    Raises :class:`~mahout.loader.BudgetError` before registering anything when one
    model alone does not fit in the budget.
    """
    budget = default_budget_mb() if memory_budget_mb is None else memory_budget_mb
    measured = [
        benchmark_model(name, home, threads, rebenchmark=rebenchmark, out=out, gpu=gpu, budget_mb=budget)
        for name in models
    ]
    vram_budget = gpu.gpu.free_mb if gpu is not None and gpu.active and gpu.gpu is not None else None
    check_fits(
        {model.model: model.footprint_mb for model in measured},
        budget,
        vram_mb={model.model: model.vram_mb for model in measured},
        vram_budget_mb=vram_budget,
    )
    accepted = qualify_with_server(api, measured, out=out)
    paths = {model.model: model.path for model in accepted}
    offloads = {model.model: model.offload for model in accepted}
    specs = {model.model: model_spec(model.model, home, CATALOG) for model in accepted}
    each = {
        model.model: slots_for(model, home, threads, requested=slots, budget_mb=budget, out=out) for model in accepted
    }
    footprints = {
        model.model: model.footprint_mb + (each[model.model] * kv_mb(model) if each[model.model] > 1 else 0.0)
        for model in accepted
    }  # (one sequence's KV is in the benchmark's measure; several are allocated up front)
    check_fits(footprints, budget)
    loader = ModelLoader(
        lambda name: specs[name].open(paths[name], threads, offloads[name], slots=each[name]),
        footprints,
        budget,
        out=out,
        vram_mb={model.model: model.vram_mb for model in accepted},
        vram_budget_mb=vram_budget,
    )
    loader.preload([model.model for model in accepted])
    return HostLoop(
        api,
        loader,
        fingerprint=accepted[0].fingerprint,
        home=home,
        idle=idle,
        installed=installed_models(home),
        out=out,
        slots=min(each.values()),
    )
