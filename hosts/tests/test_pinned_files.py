"""The catalog pins each model's file (issue 19): a qualification of another file is refused
with a clear error; mahout checks its file before benchmarking, and `mahout add` serves an
owner's own copy only when it is the catalog's file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from django.test import Client

from catalog.models import CatalogModel
from hosts.models import Qualification
from mahout import __main__ as cli
from mahout import catalog as host_catalog
from mahout.catalog import CATALOG, WrongFile, checked_file, file_sha256
from protocol.catalog import MODEL_FILES

PIN = MODEL_FILES["gemma-3-270m"]["sha256"]
BENCHMARK = {"prompt_tps": 100.0, "gen_tps": 40.0, "ttft_ms": 10.0, "memory_mb": 300.0}


@pytest.mark.django_db
class GatewayTests:
    def qualify(self, serving, sha256: str | None) -> tuple[int, dict]:  # noqa: ANN001
        body = {"model": "gemma-3-270m", "fingerprint": serving.fingerprint, "benchmark": BENCHMARK}
        if sha256 is not None:
            body["sha256"] = sha256
        response = Client().post(
            "/hosts/api/qualifications",
            data=json.dumps(body),
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {serving.token}",
        )
        return response.status_code, response.json()

    def test_the_shipped_models_name_their_files(self, catalog) -> None:  # noqa: ANN001
        assert (catalog.sha256, catalog.quantization) == (PIN, "Q4_K_M")
        assert CatalogModel.objects.get(name="all-minilm-l6-v2").sha256 == MODEL_FILES["all-minilm-l6-v2"]["sha256"]

    def test_another_file_is_refused_with_which_file_the_catalog_means(self, catalog) -> None:  # noqa: ANN001
        from testkit.personas import make_host

        serving = make_host(qualified=False)
        for sha256 in ("0" * 64, None):
            status, body = self.qualify(serving, sha256)
            assert (status, body["error"]["code"], body["error"]["param"]) == (409, "model_file_mismatch", "sha256")
            assert PIN in body["error"]["message"] and "Q4_K_M" in body["error"]["message"]
        assert not Qualification.objects.filter(host=serving.host).exists()
        status, _ = self.qualify(serving, PIN.upper())
        assert status == 201 and Qualification.objects.get(host=serving.host).sha256 == PIN

    def test_a_model_that_pins_nothing_takes_any_file(self, catalog) -> None:  # noqa: ANN001
        from testkit.personas import make_host

        CatalogModel.objects.filter(pk=catalog.pk).update(sha256="")
        assert self.qualify(make_host(qualified=False), None)[0] == 201


class HostTests:
    @pytest.fixture
    def small_pin(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
        """A small file standing in for the catalog's GGUF (the logic is the same; 250 MB is not needed)."""
        model = tmp_path / "downloads" / "my-gemma.gguf"
        model.parent.mkdir()
        model.write_bytes(b"GGUF" + bytes(range(256)) * 64)
        monkeypatch.setitem(MODEL_FILES, "gemma-3-270m", {"sha256": file_sha256(model), "quantization": "Q4_K_M"})
        return model

    def test_add_refuses_a_file_that_is_no_catalog_models(self, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
        renamed = tmp_path / "gemma-3-270m.gguf"
        renamed.write_bytes(b"GGUF another model, renamed")
        assert cli.main(["add", str(renamed), "--home", str(tmp_path / "home")]) == 2
        assert "is no catalog model's file" in capsys.readouterr().err
        assert not (tmp_path / "home" / "models" / "gemma-3-270m.added.json").exists()

    def test_an_added_copy_is_served_from_where_it_is_until_it_changes(
        self,
        small_pin: Path,
        tmp_path: Path,
        capsys: pytest.CaptureFixture,
    ) -> None:
        home = tmp_path / "home"
        assert cli.main(["add", str(small_pin), "--home", str(home)]) == 0
        assert "is the catalog's gemma-3-270m (Q4_K_M" in capsys.readouterr().out
        spec = CATALOG["gemma-3-270m"]
        path, sha256 = spec.locate(home)
        assert path == small_pin.resolve() and sha256 == MODEL_FILES["gemma-3-270m"]["sha256"]
        checked_file(spec, path, sha256)  # the catalog's file: benchmarked and served
        small_pin.write_bytes(b"GGUF quietly replaced by something else")
        path, sha256 = spec.locate(home)
        with pytest.raises(WrongFile, match="the catalog's gemma-3-270m is the Q4_K_M file"):
            checked_file(spec, path, sha256)

    def test_the_benchmark_refuses_a_file_that_is_not_the_pin(
        self, small_pin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from mahout.host import benchmark_model

        home = tmp_path / "home"
        assert cli.main(["add", str(small_pin), "--home", str(home)]) == 0
        small_pin.write_bytes(b"GGUF not it")
        measured = []
        monkeypatch.setattr(host_catalog, "_measure_chat", lambda *a, **k: measured.append(a) or BENCHMARK)
        with pytest.raises(WrongFile):
            benchmark_model("gemma-3-270m", home, 1, out=lambda line: None)
        assert measured == [], "nothing is measured for the wrong file"
