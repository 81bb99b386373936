"""Model assembly from chunk files, with a fake chunk package (no 250 MB copy)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace

import pytest

from mahout import model_files


def fake_package(tmp_path: Path, parts: list[bytes], expected: str | None = None) -> SimpleNamespace:
    paths = []
    for index, data in enumerate(parts):
        path = tmp_path / f"chunk{index}"
        path.write_bytes(data)
        paths.append(path)
    return SimpleNamespace(
        EXPECTED_SHA256=expected or hashlib.sha256(b"".join(parts)).hexdigest(),
        chunk_paths=lambda: paths,
        verify_chunks=lambda: None,
    )


class AssembleShippedTests:
    def test_it_concatenates_the_chunks_and_records_the_hash(self, tmp_path, monkeypatch):
        package = fake_package(tmp_path, [b"GGUF", b"-body-", b"end"])
        monkeypatch.setattr(model_files, "_package", lambda: package)
        home = tmp_path / "home"
        path = model_files.assemble_shipped(home, progress=False)
        assert path == home / "models" / "gemma-3-270m.gguf"
        assert path.read_bytes() == b"GGUF-body-end"
        assert model_files.recorded_sha256(home) == package.EXPECTED_SHA256

    def test_it_skips_a_model_already_assembled(self, tmp_path, monkeypatch):
        package = fake_package(tmp_path, [b"abc"])
        monkeypatch.setattr(model_files, "_package", lambda: package)
        path = model_files.assemble_shipped(tmp_path, progress=False)
        package.chunk_paths = lambda: pytest.fail("re-assembled an assembled model")
        assert model_files.assemble_shipped(tmp_path, progress=False) == path

    def test_it_refuses_chunks_that_do_not_match_the_published_hash(self, tmp_path, monkeypatch):
        monkeypatch.setattr(model_files, "_package", lambda: fake_package(tmp_path, [b"abc"], expected="0" * 64))
        with pytest.raises(ValueError, match="expected 0000"):
            model_files.assemble_shipped(tmp_path / "home", progress=False)
        assert list((tmp_path / "home" / "models").iterdir()) == []
