"""`canary_references --model NAME --gguf PATH` for any catalog model: references are that
model's own answers, from its own file, rendered in its own template."""

from __future__ import annotations

import pytest
from django.core.management import CommandError, call_command

from catalog.services import catalog_model_add
from marketplace.models import CanaryReference

pytestmark = pytest.mark.django_db


@pytest.fixture
def entry(family_files, tmp_path, settings):  # noqa: ANN001, ANN201
    settings.VAR_DIR = tmp_path / "var"
    return catalog_model_add(path=family_files["qwen3"], name="tiny-qwen3", input_price="0.1", output_price="0.4")


class CanaryReferencesCommandTests:
    def test_a_catalog_added_model_needs_its_own_file(self, entry) -> None:
        with pytest.raises(CommandError, match="--gguf PATH is needed: tiny-qwen3's own file"):
            call_command("canary_references", "--model", "tiny-qwen3")

    def test_another_models_file_is_refused(self, entry, family_files) -> None:
        with pytest.raises(CommandError, match="is not tiny-qwen3's file"):
            call_command("canary_references", "--model", "tiny-qwen3", "--gguf", str(family_files["llama3"]))

    def test_it_runs_every_prompt_through_the_models_own_file(self, entry, family_files, capsys) -> None:
        call_command(
            "canary_references",
            "--model",
            "tiny-qwen3",
            "--gguf",
            str(family_files["qwen3"]),
            "--count",
            "4",
            "--max-tokens",
            "6",
            "--threads",
            "1",
        )
        out = capsys.readouterr().out
        # random weights hesitate everywhere: nothing is decisive enough to keep, and each prompt says so
        assert out.count("too little to check before a near-tie") == 4 and "Kept 0 references" in out, out
        assert not CanaryReference.objects.filter(model=entry).exists()

    def test_a_reference_is_what_a_host_serving_the_model_writes(self, entry, family_files) -> None:
        from catalog.rendering import chat_format
        from mahout.runners.llama import LlamaRunner
        from marketplace.lifecycle import canaries
        from scorer.llama import load_llama

        item = {
            "kind": "chat",
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river."}],
        }
        llm = load_llama(family_files["qwen3"], n_ctx=canaries.REFERENCE_CTX, threads=1, logits_all=True)
        host = LlamaRunner(family_files["qwen3"], threads=1, n_ctx=256)
        try:
            reference = canaries.reference_of(llm, item, fmt=chat_format(entry), max_tokens=6, tie_gap=0.5)
            job = {
                **canaries.canary_job(chat_format(entry), kind="chat", messages=item["messages"], prompt=None),
                "params": {"max_tokens": 6, "temperature": 0.0},
            }
            assert "".join(host.stream(job)) == reference.text and reference.tokens == 6
        finally:
            host.close()
            llm.close()
