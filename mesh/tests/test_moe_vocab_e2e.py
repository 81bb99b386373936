"""Real MoE architectures with their own vocabularies through the market, with real processes
on loopback: `testkit.families`' tiny `qwen3moe` (Qwen 3's 151,936-token vocabulary and chat
template, 3 layers of 8 experts, 2 per token) and tiny Mixtral (llama blocks with 8 experts,
Mistral's vocabulary and template), each through both tests.

- An operator publishes it (`manage.py moe_register`): its catalog entry counts tokens with
  the file's own vocabulary (a vocabulary-only copy, as `catalog_add` keeps one) and renders
  chats with Qwen's template; its expert record has the file's 3 x 8 experts, cut into slices
  of 4. A real `python -m mahout moe coordinator` qualifies it, claims a customer's chat and
  streams the engine's greedy text; the request is billed for the tokens the model's own
  vocabulary counts, not bytes. A `response_format` holds its answer to the schema's grammar,
  and `logprobs` come with each token.
- A volunteer process is handed a slice of its real experts, downloads that slice file from
  the gateway and serves it (through the relay); the coordinator sends it that slice's
  experts and the answer stays token for token what the model computes alone.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import openai
import pytest
from django.core.management import call_command
from gguf import GGUFReader

from conftest import ROOT, make_customer, make_host, stack_env, wait_until
from engine.moe import MoeModel
from engine.moe_loader import expert_tensor_names, load_moe
from mahout.moe.control import CoordinatorAgent, MeshClient
from mahout.moe.policy import DispatchPolicy, LoadState
from mahout.moe.runner import MoeRunner, Vocabulary, as_streamed
from mesh.tests.market import trusted_host
from protocol.rendering import fragments_text

if TYPE_CHECKING:
    from catalog.models import CatalogModel
    from testkit.stack import Gateway

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

MESSAGES = [{"role": "user", "content": "Tell me about elephants."}]
N_TOKENS = 16


@pytest.fixture(params=["qwen3moe", "mixtral"])
def moe_family(request: pytest.FixtureRequest) -> tuple[str, Path, str]:
    """Each real MoE layout with its own vocabulary: the family, its tiny file, and a marker of
    its chat template (Qwen's ChatML; Mistral's [INST])."""
    marker = {"qwen3moe": "<|im_start|>", "mixtral": "[INST]"}[request.param]
    return request.param, request.getfixturevalue(f"{request.param}_file"), marker


def _local_answer(path: Path, job: dict) -> tuple[list[int], str]:
    """The prompt's ids and the model's greedy text with every expert computed here."""
    config, weights = load_moe(path)
    vocabulary = Vocabulary(path)
    prompt = vocabulary.prompt(job)
    ids = MoeModel(config, weights, n_rows=1, n_ctx=256).generate(
        prompt, N_TOKENS, stop_ids=tuple(vocabulary.stop_ids(job))
    )
    return prompt, as_streamed(vocabulary.spell(ids))  # as llama.cpp's stream writes it


class RealVocabularyServesTests:
    def test_it_is_counted_with_its_own_vocabulary_and_streams_the_engines_text(
        self,
        gateway: Gateway,
        catalog: CatalogModel,
        moe_family: tuple[str, Path, str],
        tmp_path: Path,
        e2e_dirs: Path,
    ) -> None:
        from catalog.models import CatalogModel
        from catalog.rendering import chat_format, prompt_fragments
        from hosts.models import Host
        from marketplace.models import Job, Request
        from mesh.experts.models import ExpertModel

        family, path, template_marker = moe_family
        name = f"tiny-{family}"
        host = make_host(qualified=False, name=f"{family}-coordinator")
        call_command(
            "moe_register",
            str(path),
            "--name",
            name,
            "--coordinator-host",
            host.host.name,
            "--slice-size",
            "4",
            stdout=io.StringIO(),
        )
        entry = CatalogModel.objects.get(name=name)
        assert entry.tokenizer.startswith("gguf:catalog/") and template_marker in entry.chat_template
        assert (entry.n_experts, entry.context_length, entry.input_price_ucents) == (8, 2048, 10)
        expert_model = ExpertModel.objects.get(name=name)
        assert (expert_model.n_layers, expert_model.n_experts, expert_model.n_experts_used) == (3, 8, 2)
        fragments = [
            list(fragment) for fragment in prompt_fragments(entry, kind="chat", messages=MESSAGES, prompt=None)
        ]
        prompt, expected = _local_answer(
            path, {"fragments": fragments, "end_of_turn": list(chat_format(entry).end_of_turn)}
        )

        log_path = e2e_dirs / "logs" / f"{family}-coordinator-{time.time_ns()}.log"
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
                str(path),
                "--name",
                name,
                "--slots",
                "1",
                "--report",
                "0.5",
                "--claim-wait",
                "2",
                "--home",
                str(tmp_path / "home"),
                "--no-idle-detect",
                "--ctx",
                "512",
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

            wait_until(ready, timeout=120, what=f"the coordinator to qualify {name}", interval=0.3)
            time.sleep(0.3)  # its first long-poll is on the way
            assert "KV cache" in log_path.read_text() and "× 512 tokens of context" in log_path.read_text()
            client = openai.OpenAI(
                base_url=f"{gateway.url}/v1", api_key=make_customer().secret, max_retries=0, timeout=60
            )
            answer = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=N_TOKENS, temperature=0)
            assert answer.choices[0].message.content == expected, log_path.read_text()

            row = Request.objects.get(model=entry)
            assert row.status == Request.Status.COMPLETED
            assert (
                row.prompt_tokens == len(prompt) < len(fragments_text(fragments).encode())
            )  # its vocabulary's count, not bytes
            assert row.completion_tokens > 0
            assert row.cost_ucents == row.prompt_tokens * 10 + row.completion_tokens * 40
            assert Job.objects.get(request=row).host_id == host.host.pk

            schema = {
                "type": "object",
                "properties": {"animal": {"enum": ["elephant", "mouse"]}},
                "required": ["animal"],
                "additionalProperties": False,
            }
            shaped = client.chat.completions.create(
                model=name,
                messages=MESSAGES,
                max_tokens=64,
                temperature=0,
                response_format={
                    "type": "json_schema",
                    "json_schema": {  # type: ignore[typeddict-item]
                        "name": "animal",
                        "schema": schema,
                        "strict": True,
                    },
                },
            )
            assert json.loads(shaped.choices[0].message.content or "")["animal"] in (
                "elephant",
                "mouse",
            )  # its grammar held it
            assert shaped.choices[0].finish_reason == "stop"
            scored = client.chat.completions.create(
                model=name, messages=MESSAGES, max_tokens=N_TOKENS, temperature=0, logprobs=True, top_logprobs=2
            )
            content = scored.choices[0].logprobs.content  # type: ignore[union-attr]
            assert (
                content and "".join(entry.token for entry in content) == scored.choices[0].message.content == expected
            )
            assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in content)
            process.terminate()
            assert process.wait(timeout=15) == 0, log_path.read_text()
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


class RealSliceVolunteerTests:
    def test_a_volunteer_serving_a_real_slice_keeps_the_answer(
        self,
        gateway: Gateway,
        catalog: CatalogModel,
        moe_family: tuple[str, Path, str],
        tmp_path: Path,
        e2e_dirs: Path,
    ) -> None:
        from mesh.experts import services as moe_services
        from mesh.experts.models import ExpertWorker

        family, path, _ = moe_family
        name = f"tiny-{family}-market"
        coordinator_host, volunteer_host = make_host(name=f"{family}-coord"), trusted_host(f"{family}-volunteer")
        moe_services.moe_model_publish(name=name, gguf_path=path, coordinator=coordinator_host.host)
        _, entry = moe_services.moe_model_publish(
            name=name, gguf_path=path, slice_size=4, boost=1, output_price_ucents=7
        )  # again: prices and targets updated
        assert entry.tokenizer.startswith("gguf:catalog/") and entry.output_price_ucents == 7
        vocabulary = Vocabulary(path)
        prompt = vocabulary.encode("The elephant never forgets")
        config, weights = load_moe(path)
        expected = MoeModel(config, weights, n_rows=1, n_ctx=256).generate(prompt, N_TOKENS)

        runner = MoeRunner(path, policy=DispatchPolicy(grace_s=30.0), n_slots=2, n_ctx=256)
        runner.monitor.state = LoadState(busy=2, under_load=True, last_load_at=0.0)  # saturated, as reported below
        client = MeshClient(gateway.url, coordinator_host.token)
        agent = CoordinatorAgent(runner, client, name, interval_s=0.3)
        workdir = tmp_path / "volunteer"
        log = (e2e_dirs / "logs" / f"{family}-volunteer.log").open("w")
        volunteer = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mahout",
                "moe",
                "volunteer",
                "--server",
                gateway.url,
                "--token",
                volunteer_host.token,
                "--poll",
                "0.3",
                "--heartbeat",
                "0.5",
                "--no-idle-detect",
                "--home",
                str(tmp_path / "volunteer-home"),
                "--workdir",
                str(workdir),
            ],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            agent.tick()  # busy 2: saturated, one replica per slice wanted

            def attached() -> bool:
                assert volunteer.poll() is None, f"the volunteer exited: see {family}-volunteer.log"
                agent.tick()
                return len(runner.coordinator.workers) == 1

            wait_until(attached, timeout=90, what="the volunteer to serve its slice", interval=0.3)
            # (a download that timed out on a loaded machine was given back: that worker retired)
            worker = ExpertWorker.objects.exclude(status=ExpertWorker.Status.RETIRED).get(host=volunteer_host.host)
            (slice_file,) = workdir.glob("slice-*.gguf")
            held = GGUFReader(str(slice_file)).tensors
            assert {t.name for t in held} == set(expert_tensor_names(worker.layer))
            assert {int(t.shape[-1]) for t in held} == {worker.count} == {4}  # 4 of the layer's 8 experts
            assert runner.generate(prompt, N_TOKENS) == expected
            stats = runner.coordinator.stats
            assert stats.remote_experts > 0 and stats.fallbacks == 0
        finally:
            runner.close()
            client.close()
            volunteer.kill()
            volunteer.wait()
            log.close()
