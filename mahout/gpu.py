"""The GPU, when this machine has one: what is there, what llama.cpp was built for, and how
many of a model's layers to put on it.

The hardware is found with the vendor's own tool (``nvidia-smi``, ``rocm-smi``) or, on an
Apple silicon Mac, the platform (Metal shares the machine's memory). What llama-cpp-python
can use is llama.cpp's own answer (``llama_supports_gpu_offload`` and the backends named in
``llama_print_system_info``): a GPU is used only when both agree. When the hardware is there
but the build is CPU-only, the host says so at start with the command that rebuilds it.

``--gpu-layers auto`` (the default) puts every layer that fits the GPU's free memory there,
measured at start, less a reserve for the context and the compute buffers; a number asks for
that many; 0 keeps everything on the CPU. Every figure here is a plan: the benchmark
measures what the plan gives.
"""

from __future__ import annotations

import platform
import shutil
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

from mahout.idle import run_command

COMMAND_TIMEOUT_SECONDS = 5.0
RESERVE_MB = 768.0  # left free on the GPU: the context's KV cache and llama.cpp's compute buffers
AUTO = "auto"

REBUILD_FLAGS = {"nvidia": "-DGGML_CUDA=on", "apple": "-DGGML_METAL=on", "amd": "-DGGML_HIP=on"}
BACKEND_OF = {"nvidia": "CUDA", "apple": "Metal", "amd": "HIP"}  # as llama_print_system_info names them


@dataclass(frozen=True)
class Gpu:
    vendor: str  # "nvidia", "apple" or "amd"
    name: str
    total_mb: float
    free_mb: float


@dataclass(frozen=True)
class Offload:
    """How much of one model goes on the GPU."""

    layers: int  # llama.cpp's n_gpu_layers (0: none; the model's layers + 1: all, its output layer too)
    n_layers: int
    vram_mb: float  # the weights planned on the GPU
    device: str  # "cpu", or the GPU's name


def _run(argv: list[str]) -> str | None:
    return run_command(argv, timeout=COMMAND_TIMEOUT_SECONDS)


def gpus_present(
    run: Callable[[list[str]], str | None] = _run,
    which: Callable[[str], str | None] = shutil.which,
    system: str = sys.platform,
    machine: str | None = None,
    memory_mb: Callable[[], float] | None = None,
) -> list[Gpu]:
    """The GPUs this machine has, whatever llama.cpp was built for (the tools and the platform
    are injectable: tests stub them at this boundary)."""
    found: list[Gpu] = []
    if which("nvidia-smi"):
        out = run(["nvidia-smi", "--query-gpu=name,memory.total,memory.free", "--format=csv,noheader,nounits"]) or ""
        for line in out.strip().splitlines():
            parts = [part.strip() for part in line.split(",")]
            if len(parts) == 3:
                try:
                    found.append(Gpu("nvidia", parts[0], float(parts[1]), float(parts[2])))
                except ValueError:
                    continue
    if not found and which("rocm-smi"):
        out = run(["rocm-smi", "--showproductname", "--showmeminfo", "vram", "--csv"]) or ""
        found += _rocm(out)
    if not found and system == "darwin" and (machine or platform.machine()) == "arm64":
        total = (memory_mb or _mac_memory_mb)()
        found.append(Gpu("apple", "Apple silicon (Metal)", total, total * 0.75))  # Metal's usual working-set cap
    return found


def _rocm(out: str) -> list[Gpu]:
    """rocm-smi's CSV: one row per card with its total and used VRAM in bytes."""
    lines = [line for line in out.strip().splitlines() if line]
    if len(lines) < 2:
        return []
    header = [cell.strip().lower() for cell in lines[0].split(",")]
    gpus = []
    for line in lines[1:]:
        row = dict(zip(header, (cell.strip() for cell in line.split(",")), strict=False))
        try:
            total = float(row.get("vram total memory (b)", "")) / 2**20
            used = float(row.get("vram total used memory (b)", "")) / 2**20
        except ValueError:
            continue
        gpus.append(Gpu("amd", row.get("card series") or row.get("card model") or "AMD GPU", total, total - used))
    return gpus


def _mac_memory_mb() -> float:
    out = _run(["sysctl", "-n", "hw.memsize"]) or "0"
    try:
        return int(out.strip()) / 2**20
    except ValueError:
        return 0.0


def llama_backends(info: str | None = None) -> list[str]:
    """The backends this llama-cpp-python was built with ("CPU", "CUDA", "Metal", ...)."""
    if info is None:
        import llama_cpp

        info = llama_cpp.llama_print_system_info().decode("utf-8", errors="replace")
    return list(dict.fromkeys(part.split(":")[0].strip() for part in info.split("|") if ":" in part))


def offload_supported() -> bool:
    """llama.cpp's own answer: can this build put layers on a GPU?"""
    import llama_cpp

    return bool(llama_cpp.llama_supports_gpu_offload())


def rebuild_command(vendor: str) -> str:
    """The command that rebuilds llama-cpp-python for this vendor's GPU."""
    import llama_cpp

    return (
        f'CMAKE_ARGS="{REBUILD_FLAGS[vendor]}" pip install --force-reinstall --no-cache-dir '
        f"llama-cpp-python=={llama_cpp.__version__}"
    )


def startup_report(gpus: list[Gpu], supported: bool, backends: list[str]) -> list[str]:
    """What mahout says at start about the GPU: what it will use, or why it will not."""
    if not gpus:
        return ["mahout: no GPU found: serving on the CPU"]
    gpu = gpus[0]
    if not supported:
        return [
            f"mahout: warning: this machine has a GPU ({gpu.name}, {gpu.free_mb:.0f} of {gpu.total_mb:.0f} MB free) "
            f"but llama-cpp-python was built for the CPU only ({', '.join(backends) or 'CPU'}), so the GPU sits idle. "
            f"Rebuild it: {rebuild_command(gpu.vendor)}"
        ]
    return [
        f"mahout: GPU {gpu.name}: {gpu.free_mb:.0f} of {gpu.total_mb:.0f} MB free; llama.cpp backends: "
        f"{', '.join(backends)}"
    ]


def parse_gpu_layers(text: str) -> str | int:
    """`--gpu-layers`: "auto" or a whole number of 0 or more."""
    if text == AUTO:
        return AUTO
    value = int(text)
    if value < 0:
        raise ValueError("must be auto or a number of layers (0: none)")
    return value


def plan_offload(
    requested: str | int,
    *,
    gpu: Gpu | None,
    supported: bool,
    model_mb: float,
    n_layers: int,
    reserve_mb: float = RESERVE_MB,
) -> Offload:
    """How many of a model's layers go on the GPU. llama.cpp counts the output layer as one
    more, so `n_layers + 1` puts everything there. Each layer is taken to weigh an equal
    share of the file (the embeddings stay on the CPU with llama.cpp's default split)."""
    if gpu is None or not supported or requested == 0 or n_layers <= 0:
        return Offload(0, n_layers, 0.0, "cpu")
    per_layer = model_mb / (n_layers + 1)
    if requested == AUTO:
        layers = int(max(gpu.free_mb - reserve_mb, 0.0) // per_layer) if per_layer > 0 else n_layers + 1
    else:
        layers = int(requested)
    layers = min(layers, n_layers + 1)
    return Offload(layers, n_layers, round(layers * per_layer, 1), gpu.name if layers else "cpu")


def model_layers(path: object) -> int:
    """The number of transformer layers of a GGUF, read from its metadata by llama.cpp with
    the vocabulary only loaded (milliseconds), quietly; 0 when it does not say."""
    count = model_meta(path, ["block_count"]).get("block_count", "")
    return int(count) if count.isdigit() else 0


def kv_mb_per_sequence(path: object, n_ctx: int) -> float:
    """The KV cache one sequence of ``n_ctx`` tokens takes (MiB, 16-bit keys and values, every
    layer full: an upper bound where a model's sliding-window layers keep less), from the GGUF's
    metadata; 0 when it does not say."""
    facts = model_meta(
        path,
        [
            "block_count",
            "attention.head_count",
            "attention.head_count_kv",
            "attention.key_length",
            "attention.value_length",
            "embedding_length",
        ],
    )
    number = {key: int(value) for key, value in facts.items() if value.isdigit()}
    heads = number.get("attention.head_count", 0)
    kv_heads = number.get("attention.head_count_kv", heads)
    head_dim = number.get("embedding_length", 0) // heads if heads else 0
    per_token = kv_heads * (
        number.get("attention.key_length", head_dim) + number.get("attention.value_length", head_dim)
    )
    return number.get("block_count", 0) * n_ctx * per_token * 2 / 2**20


def model_meta(path: object, keys: list[str]) -> dict[str, str]:
    """Values of a GGUF's architecture keys (``block_count`` for ``<arch>.block_count``), read
    by llama.cpp with the vocabulary only loaded (milliseconds), quietly; those it does not have
    are left out."""
    import ctypes

    import llama_cpp

    try:
        from llama_cpp._utils import suppress_stdout_stderr  # what `Llama(verbose=False)` uses

        quiet: AbstractContextManager[object] = suppress_stdout_stderr(disable=False)
    except ImportError:  # pragma: no cover - another llama-cpp-python layout: noisier, same answer
        import contextlib

        quiet = contextlib.nullcontext()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    with quiet:
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        return {}
    try:

        def meta(key: str) -> str:
            value = ctypes.create_string_buffer(128)
            written = llama_cpp.llama_model_meta_val_str(model, key.encode(), value, len(value))
            return value.value.decode() if written > 0 else ""

        arch = meta("general.architecture")
        found = {key: meta(f"{arch}.{key}") for key in keys}
        return {key: value for key, value in found.items() if value}
    finally:
        llama_cpp.llama_model_free(model)
