"""The MoE coordinator serves through the marketplace, with real processes on loopback: an
operator registers the tiny MoE GGUF and binds its coordinator (`manage.py moe_register
--coordinator-host`), a real `python -m mahout moe coordinator` process benchmarks and
qualifies it, claims the job through the host API and streams its tokens back; the
customer's `openai` client sees the local model's exact text, and the request settles like
any other (billed, the host paid 80%)."""

from __future__ import annotations

import io
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import openai
import pytest
from django.core.management import call_command

from conftest import ROOT, make_customer, make_host, stack_env, wait_until
from engine.moe import MoeModel
from engine.moe_loader import BYTE_EOS, ByteTokenizer, load_moe, make_tiny_moe
from mahout.moe.runner import as_streamed
from protocol.rendering import chat_fragments, fragments_text
from testkit.formats import BYTES

if TYPE_CHECKING:
    from catalog.models import CatalogModel
    from testkit.stack import Gateway

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

MESSAGES = [{"role": "user", "content": "Tell me about elephants."}]
N_TOKENS = 24


def _local_text(path: Path) -> str:
    """What the model answers with every expert computed here (greedy)."""
    config, weights = load_moe(path)
    tokenizer = ByteTokenizer()
    ids = MoeModel(config, weights).generate(
        tokenizer.encode(fragments_text(chat_fragments(BYTES, MESSAGES))), N_TOKENS, stop_ids=(BYTE_EOS,)
    )
    return as_streamed(bytes(t for t in ids if t < 256))  # as llama.cpp's stream writes it


class CoordinatorServesTests:
    def test_it_qualifies_claims_streams_and_the_request_settles(
        self, gateway: Gateway, catalog: CatalogModel, tmp_path: Path, e2e_dirs: Path
    ) -> None:
        from catalog.models import CatalogModel
        from hosts.models import Host
        from marketplace.models import Job, Request
        from mesh.experts.models import ExpertModel

        tiny = make_tiny_moe(tmp_path / "tiny-moe.gguf", seed=5)
        host = make_host(qualified=False, name="moe-coordinator")
        call_command(
            "moe_register",
            str(tiny),
            "--name",
            "tiny-moe",
            "--coordinator-host",
            "moe-coordinator",
            stdout=io.StringIO(),
        )
        entry = CatalogModel.objects.get(name="tiny-moe")
        assert (entry.kind, entry.tokenizer, entry.context_length) == ("chat", "bytes", 256)
        log_path = e2e_dirs / "logs" / f"moe-coordinator-{time.time_ns()}.log"
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mahout",
                "moe",
                "coordinator",
                "--server",
                gateway.url,
                "--token",
                host.token,
                "--model",
                str(tiny),
                "--name",
                "tiny-moe",
                "--slots",
                "2",
                "--report",
                "0.5",
                "--claim-wait",
                "2",
                "--home",
                str(tmp_path / "home"),
                "--no-idle-detect",
            ],
            cwd=ROOT,
            env=stack_env(),
            stdout=log_path.open("w"),
            stderr=subprocess.STDOUT,
        )
        try:

            def ready() -> bool:
                assert process.poll() is None, f"the coordinator exited:\n{log_path.read_text()}"
                row = Host.objects.get(pk=host.host.pk)
                return bool(row.last_heartbeat_at and row.qualifications.filter(model=entry).exists())

            wait_until(ready, timeout=60, what="the coordinator to qualify tiny-moe", interval=0.2)
            time.sleep(0.3)  # its first long-poll is on the way
            expected = _local_text(tiny)
            customer = make_customer()
            client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=customer.secret, max_retries=0, timeout=60)
            stream = client.chat.completions.create(
                model="tiny-moe", messages=MESSAGES, max_tokens=N_TOKENS, temperature=0, stream=True
            )
            chunks = list(stream)
            text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
            assert text == expected, log_path.read_text()
            assert chunks[-1].choices[0].finish_reason in ("stop", "length")

            row = Request.objects.select_related("model").get(model__name="tiny-moe")
            assert row.status == Request.Status.COMPLETED
            assert row.cost_ucents > 0
            assert row.cost_ucents == row.prompt_tokens * 10 + row.completion_tokens * 40
            assert (
                row.prompt_tokens == len(fragments_text(chat_fragments(BYTES, MESSAGES)).encode()) + 1
            )  # the bytes, and BOS
            job = Job.objects.get(request=row)
            assert job.host_id == host.host.pk and job.earned_ucents == row.cost_ucents * 80 // 100
            wait_until(
                lambda: ExpertModel.objects.get(name="tiny-moe").coordinator_id == host.host.pk,
                timeout=10,
                what="the coordinator's load report",
            )
            process.terminate()  # the first SIGTERM: the slots finish, their long-polls end, it exits cleanly
            assert process.wait(timeout=15) == 0, log_path.read_text()
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
