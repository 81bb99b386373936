"""The models a home serves beyond the shipped two: a catalog file the owner added (`mahout
add`) is served under the catalog's name, held to the pin the catalog gave, and planned in
memory by its file's size. (Matching against a live gateway: hosts/tests/test_catalog_files.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from mahout import catalog as host_catalog
from mahout import host
from mahout.__main__ import main
from mahout.catalog import (
    CATALOG,
    CatalogFile,
    ModelUnavailable,
    WrongFile,
    catalog_match,
    checked_file,
    file_sha256,
    known_models,
    model_spec,
    offline_catalog,
)
from mahout.loader import BudgetError
from mahout.model_files import model_add
from mahout.tests.fake_gateway import TOKEN
from protocol.catalog import MODEL_FILES

MIB = 2**20


def added(home: Path, path: Path, name: str = "org/tiny-chat:q8", **entry: object) -> CatalogFile:
    """Record `path` as the catalog's `name`, as `mahout add` does after a match."""
    listed = CatalogFile.from_listing(
        {
            "name": name,
            "kind": "chat",
            "sha256": file_sha256(path),
            "quantization": "Q8_0",
            "context_length": 2048,
            **entry,
        }
    )
    model_add(home, name, path, listed.sha256, entry=listed.record())
    return listed


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "downloads" / "tiny-chat.Q8_0.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF" + b"\0" * (2 * MIB))
    return path


class CatalogFileTests:
    def test_it_reads_the_gateways_listing_and_matches_a_file_by_its_sha256(self) -> None:
        listing = CatalogFile.from_listing(
            {
                "name": "big",
                "kind": "chat",
                "sha256": "AB" * 32,
                "quantization": "Q4_K_M",
                "file_size": 4_920_000_000,
                "context_length": 131072,
                "embedding_dimensions": None,
                "architecture": "llama",
            }
        )
        assert (listing.sha256, listing.file_size, listing.context_length) == ("ab" * 32, 4_920_000_000, 131072)
        assert listing.describe() == f"big (Q4_K_M, 4.9 GB, sha256 {'ab' * 32})"
        assert catalog_match("AB" * 32, [listing]) == [listing]
        assert catalog_match("cd" * 32, [listing]) == []

    def test_offline_it_knows_the_files_mahout_ships(self) -> None:
        assert {(entry.name, entry.kind, entry.sha256) for entry in offline_catalog()} == {
            ("gemma-3-270m", "chat", MODEL_FILES["gemma-3-270m"]["sha256"]),
            ("all-minilm-l6-v2", "embedding", MODEL_FILES["all-minilm-l6-v2"]["sha256"]),
        }
        assert [entry.name for entry in catalog_match(MODEL_FILES["gemma-3-270m"]["sha256"])] == ["gemma-3-270m"]


class AddedModelTests:
    def test_an_added_chat_model_is_served_under_the_catalogs_name_and_held_to_its_pin(
        self,
        tmp_path: Path,
        model_file: Path,
    ) -> None:
        home = tmp_path / "home"
        listed = added(home, model_file)
        assert known_models(home) == [*CATALOG, "org/tiny-chat:q8"]
        spec = model_spec("org/tiny-chat:q8", home)
        assert (spec.kind, spec.pinned_sha256, spec.pinned_quantization, spec.offloads) == (
            "chat",
            listed.sha256,
            "Q8_0",
            True,
        )
        path, sha256 = spec.locate(home)
        assert path == model_file.resolve() and sha256 == listed.sha256
        checked_file(spec, path, sha256)
        model_file.write_bytes(b"GGUF quietly replaced")
        with pytest.raises(
            WrongFile, match=f"the catalog's org/tiny-chat:q8 is the Q8_0 file with sha256 {listed.sha256}"
        ):
            checked_file(spec, *spec.locate(home))
        model_file.unlink()
        with pytest.raises(ModelUnavailable, match="add it again"):
            spec.locate(home)

    def test_it_runs_with_no_more_context_than_the_catalog_sells(
        self, tmp_path: Path, model_file: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        opened: list[int] = []
        monkeypatch.setattr(
            host_catalog, "_open_chat", lambda path, threads, offload=None, *, n_ctx: opened.append(n_ctx)
        )
        added(tmp_path, model_file, context_length=1024)
        added(tmp_path, model_file, name="long", context_length=131072)
        for name in ("org/tiny-chat:q8", "long"):
            model_spec(name, tmp_path).open(model_file, 1)
        assert opened == [1024, host_catalog.RUNNER_N_CTX]

    def test_a_name_neither_shipped_nor_added_is_refused_saying_how_to_add_it(self, tmp_path: Path) -> None:
        with pytest.raises(ModelUnavailable, match="mahout add PATH"):
            model_spec("llama-3.1-8b", tmp_path)

    def test_run_refuses_a_model_this_home_cannot_serve_in_one_line(
        self, tmp_path: Path, capsys: pytest.CaptureFixture
    ) -> None:
        assert main(["run", "--home", str(tmp_path), "--models", "gemma-3-270m,llama-3.1-8b"]) == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert line.startswith("mahout: error: unknown model(s) llama-3.1-8b; known: gemma-3-270m, all-minilm-l6-v2 ")

    def test_the_benchmark_serves_an_added_model_and_its_memory_plan_counts_its_file(
        self,
        tmp_path: Path,
        model_file: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        measured: list[Path] = []

        def measure(path: Path, threads: int, *, progress: bool = True, offload: object = None) -> dict:
            measured.append(path)
            return {"prompt_tps": 10.0, "gen_tps": 5.0, "ttft_ms": 9.0, "memory_mb": 1.0, "threads": threads}

        monkeypatch.setattr(host_catalog, "_measure_chat", measure)
        home = tmp_path / "home"
        listed = added(home, model_file)
        with pytest.raises(BudgetError, match=r"org/tiny-chat:q8 \(~2 MB\) cannot fit in a memory budget of 1 MB"):
            host.benchmark_model("org/tiny-chat:q8", home, 1, out=lambda line: None, budget_mb=1)
        assert measured == [], "a file bigger than the budget is refused before it is loaded"
        qualified = host.benchmark_model("org/tiny-chat:q8", home, 1, out=lambda line: None, budget_mb=3)
        assert measured == [model_file.resolve()] and (qualified.model, qualified.sha256) == (
            "org/tiny-chat:q8",
            listed.sha256,
        )
        assert qualified.footprint_mb == pytest.approx((2 * MIB + 4) / MIB), "the file's size, not the 1 MB measured"


class AddCommandTests:
    def test_a_gateway_without_a_catalog_falls_back_to_the_shipped_files(
        self,
        tmp_path: Path,
        gateway: object,
        capsys: pytest.CaptureFixture,
    ) -> None:
        other = tmp_path / "model.gguf"
        other.write_bytes(b"GGUF not a catalog file")
        assert main(["add", str(other), "--home", str(tmp_path), "--server", gateway.url, "--token", TOKEN]) == 2  # type: ignore[attr-defined]
        out, err = capsys.readouterr()
        assert "lists no catalog to hosts; matching only the files mahout ships knowing" in out
        line = err.strip().splitlines()[-1]
        assert f"(sha256 {file_sha256(other)}) is no catalog model's file" in line
        gemma, minilm = (MODEL_FILES[name]["sha256"] for name in ("gemma-3-270m", "all-minilm-l6-v2"))
        assert line.endswith(
            f"The catalog as mahout knows it offline sells: gemma-3-270m (Q4_K_M, sha256 {gemma}); "
            f"all-minilm-l6-v2 (F32, sha256 {minilm})"
        )

    def test_an_embeddings_entry_is_not_served_from_a_file(
        self, tmp_path: Path, model_file: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
    ) -> None:
        listing = [CatalogFile("bge-small", "embedding", file_sha256(model_file), "F16")]
        monkeypatch.setattr("mahout.__main__._catalog_for_add", lambda args, home: (listing, "The catalog at gw"))
        assert main(["add", str(model_file), "--home", str(tmp_path)]) == 2
        assert "is the catalog's bge-small, an embeddings model" in capsys.readouterr().err
        assert known_models(tmp_path) == list(CATALOG)
