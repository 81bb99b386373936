"""Hosts follow the catalog (issue 28): `mahout add` matches a file against the live gateway's
catalog (GET /hosts/api/catalog) and refuses any other in one line; a chat model mahout never
shipped, once an operator added it with `catalog_add` and an owner added its file, is
benchmarked, qualified and served. Real processes on loopback: the daphne gateway, mahout."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from conftest import ROOT, make_customer, make_host, stack_env, wait_until
from hosts.models import Host
from marketplace.models import Request
from testkit.stack import Mahout

if TYPE_CHECKING:
    from catalog.models import CatalogModel
    from testkit.stack import Gateway

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e]

TEMPLATE = (  # Gemma's turns, as the shipped model's relabelled copy is fed
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{{ message['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
Q4_K_S = 14  # llama.cpp's file type number


def mahout_add(path: Path, home: Path, *, server: str, token: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mahout", "add", str(path), "--home", str(home), "--server", server, "--token", token],
        cwd=ROOT,
        env=stack_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def relabelled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped Gemma GGUF with another file type in its metadata: another file (another
    sha256, a model mahout does not ship) that llama.cpp loads and runs all the same."""
    from gguf import GGUFReader

    from engine.gguf_loader import default_model_path

    copy = tmp_path_factory.mktemp("models") / "gemma-3-270m-relabelled.gguf"
    shutil.copyfile(default_model_path(), copy)
    reader = GGUFReader(str(copy), "r+")
    reader.fields["general.file_type"].parts[-1][0] = Q4_K_S
    reader.data.flush()
    del reader
    return copy


class CatalogMatchTests:
    def test_add_matches_the_gateways_catalog_and_refuses_another_file_in_one_line(
        self,
        gateway: Gateway,
        catalog: CatalogModel,
        tmp_path: Path,
    ) -> None:
        from catalog.models import CatalogModel
        from protocol.catalog import MODEL_FILES, file_sha256

        sold = tmp_path / "tiny-chat.Q8_0.gguf"
        sold.write_bytes(b"GGUF" + bytes(range(256)) * 64)
        CatalogModel.objects.create(
            name="org/tiny-chat:q8",
            kind="chat",
            context_length=2048,
            input_price_ucents=10,
            output_price_ucents=40,
            tokenizer="bytes",
            sha256=file_sha256(sold),
            quantization="Q8_0",
            file_size=sold.stat().st_size,
        )
        host, home = make_host(qualified=False), tmp_path / "home"

        added = mahout_add(sold, home, server=gateway.url, token=host.token)
        assert added.returncode == 0, added.stderr
        assert (
            f"{sold} is the catalog's org/tiny-chat:q8 (Q8_0, sha256 {file_sha256(sold)[:16]}…); "
            "`python -m mahout run --models org/tiny-chat:q8` serves it from there."
        ) in added.stdout
        record = json.loads((home / "models" / "org%2Ftiny-chat%3Aq8.added.json").read_text())
        assert record["path"] == str(sold.resolve()) and record["catalog"]["sha256"] == file_sha256(sold)

        other = tmp_path / "my-model.gguf"
        other.write_bytes(b"GGUF some other model")
        refused = mahout_add(other, home, server=gateway.url, token=host.token)
        assert refused.returncode == 2
        line = refused.stderr.strip().splitlines()[-1]
        assert line.startswith(f"mahout: error: {other} (sha256 {file_sha256(other)}) is no catalog model's file")
        assert f"The catalog at {gateway.url} sells: " in line
        for name, pin in MODEL_FILES.items():
            assert f"{name} ({pin['quantization']}, " in line and f"sha256 {pin['sha256']})" in line
        assert f"org/tiny-chat:q8 (Q8_0, 16 kB, sha256 {file_sha256(sold)})" in line
        assert sorted(path.name for path in (home / "models").glob("*.added.json")) == [
            "org%2Ftiny-chat%3Aq8.added.json"
        ]

    def test_a_refused_token_is_said_before_any_hashing(
        self, gateway: Gateway, catalog: CatalogModel, tmp_path: Path
    ) -> None:
        model = tmp_path / "model.gguf"
        model.write_bytes(b"GGUF")
        refused = mahout_add(model, tmp_path / "home", server=gateway.url, token="not-a-token")
        assert refused.returncode == 2 and "hashing" not in refused.stdout
        last = refused.stderr.strip().splitlines()[-1]
        assert (
            last.startswith("mahout: error: HTTP 401: Invalid host token.") and "mahout login" in last
        )  # (the hint, issue 31)


class ServedTests:
    def test_a_chat_model_mahout_never_shipped_is_added_benchmarked_qualified_and_served(
        self,
        gateway: Gateway,
        catalog: CatalogModel,
        relabelled: Path,
        tmp_path: Path,
    ) -> None:
        from django.conf import settings

        from catalog.services import catalog_model_add

        template = tmp_path / "gemma.jinja"
        template.write_text(TEMPLATE)
        entry = catalog_model_add(
            path=relabelled, name="gemma-relabelled", input_price="0.1", output_price="0.4", template_path=template
        )
        try:
            self._serve(gateway, relabelled, entry.sha256, tmp_path)
        finally:
            (settings.VAR_DIR / entry.tokenizer.removeprefix("gguf:")).unlink(missing_ok=True)  # the vocabulary copy

    def _serve(self, gateway: Gateway, relabelled: Path, sha256: str, tmp_path: Path) -> None:
        host, home = make_host(qualified=False, name="owner-rig"), tmp_path / "home"
        added = mahout_add(relabelled, home, server=gateway.url, token=host.token)
        assert added.returncode == 0 and "is the catalog's gemma-relabelled (Q4_K_S" in added.stdout, added.stderr
        logs = tmp_path / "logs"
        logs.mkdir()
        mahout = Mahout(
            server=gateway.url,
            token=host.token,
            home=home,
            env=stack_env(),
            log_dir=logs,
            extra=["--models", "gemma-relabelled"],
        )
        try:

            def qualified() -> bool:
                assert mahout.proc.poll() is None, f"mahout exited:\n{mahout.output()}"
                row = Host.objects.get(pk=host.host.pk)
                return bool(
                    row.last_heartbeat_at and row.qualifications.filter(model__name="gemma-relabelled").exists()
                )

            wait_until(qualified, timeout=180, what="mahout to benchmark and qualify gemma-relabelled", interval=0.3)
            assert Host.objects.get(pk=host.host.pk).qualifications.get().sha256 == sha256
            customer = make_customer()
            answer = httpx.post(
                f"{gateway.url}/v1/chat/completions",
                headers={"Authorization": f"Bearer {customer.secret}"},
                json={
                    "model": "gemma-relabelled",
                    "max_tokens": 8,
                    "temperature": 0,
                    "messages": [{"role": "user", "content": "Say hello."}],
                },
                timeout=120,
            )
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == "gemma-relabelled" and answer.json()["usage"]["completion_tokens"] > 0
            request = Request.objects.get(model__name="gemma-relabelled")
            assert request.status == "completed" and request.jobs.get().host_id == host.host.pk
        finally:
            mahout.stop()
        assert "mahout: serving gemma-relabelled for" in mahout.output()
