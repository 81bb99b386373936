"""The catalog model a ring serves and the file its stages load (`ring_model`): the one
`mahout add` registered for that name, or a path given on the command line, checked to be a
chat model the engine can slice into stages."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mahout.catalog import ModelSpec

__all__ = ["RingModel", "ring_model"]


@dataclass(frozen=True)
class RingModel:
    """The catalog model a ring serves, and the file its stages load."""

    name: str
    path: Path
    spec: ModelSpec  # what the catalog pins for `name` (checked before the ring qualifies)
    sha256: str = ""  # the file's, when `mahout add` recorded it ("": hashed when checked)


def ring_model(name: str, home: Path, path: str | Path | None = None) -> RingModel:
    """Catalog model `name` as a ring serves it: from `path` when given, else from the file
    `mahout add` registered for it (the shipped Gemma from the package's own copy unless the
    owner added one). `ModelUnavailable` for a name neither shipped nor added, an embeddings
    model, or a file the engine cannot slice into stages (its architecture, or experts)."""
    from engine.gguf_loader import default_model_path, open_gguf, read_config
    from mahout.catalog import ModelUnavailable, file_sha256, model_spec
    from mahout.model_files import SHIPPED_MODEL, added_model

    spec = model_spec(name, home)
    if spec.kind != "chat":
        raise ModelUnavailable(f"{name} is a {spec.kind} model: a ring serves chat models")
    sha256 = ""
    if path is not None:
        path = Path(path)
    elif name == SHIPPED_MODEL:
        path, sha256 = added_model(home, name, hash_file=file_sha256) or (default_model_path(), "")
    else:
        path, sha256 = spec.locate(home)
    try:
        read_config(open_gguf(path))
    except (OSError, ValueError, KeyError) as exc:
        raise ModelUnavailable(f"{name} ({path}) cannot be served as a ring: {exc}") from exc
    return RingModel(name, Path(path), spec, sha256)
