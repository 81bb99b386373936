"""Billing and generation agree for every family: the gateway's prompt count (the vocabulary-only
copy `catalog_add` keeps) equals the tokens a host feeds its model (the whole file, through the
host's own `PromptTokenizer`), exactly, over a corpus per family; a customer's text never becomes
one of the model's control tokens; a template that refuses a conversation says so.

The models are tiny real-vocabulary GGUFs of six families (`testkit.families`), each with its
family's real chat template, added to the catalog as an operator adds them. Processes and
streams are tested in `marketplace/tests/test_families_e2e.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from catalog.models import CatalogModel
from catalog.rendering import chat_format, prompt_count, prompt_fragments
from catalog.services import catalog_model_add
from protocol.jobs import CHAT, COMPLETION, job_payload_build
from protocol.rendering import TemplateRefused
from scorer.llama import PromptTokenizer, load_llama
from testkit.corpus import CHATS, COMPLETIONS
from testkit.families import FAMILIES

pytestmark = pytest.mark.django_db


def refuses_system(entry: CatalogModel) -> bool:
    """Whether the family's template refuses a system message (Gemma 2's does)."""
    try:
        prompt_fragments(
            entry,
            kind=CHAT,
            messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
            prompt=None,
        )
    except TemplateRefused:
        return True
    return False


class FamilyCountTests:
    @pytest.mark.parametrize("family", list(FAMILIES))
    def test_the_gateways_count_is_the_hosts_tokens_exactly(self, family_files, var_dir, family) -> None:
        entry = catalog_model_add(
            path=family_files[family], name=f"tiny-{family}", input_price="0.1", output_price="0.4"
        )
        host = load_llama(family_files[family], n_ctx=512, threads=1)
        try:
            tokenizer = PromptTokenizer(host)
            controls = {host.tokenize(text.encode(), add_bos=False, special=True)[0] for text in entry.control_tokens}
            system_refused = refuses_system(entry)
            jobs = [(CHAT, messages, None) for messages in CHATS] + [
                (COMPLETION, None, prompt) for prompt in COMPLETIONS
            ]
            checked = 0
            for kind, messages, prompt in jobs:
                if system_refused and any(m["role"] == "system" for m in messages or []):
                    with pytest.raises(TemplateRefused, match="[Ss]ystem"):
                        prompt_fragments(entry, kind=kind, messages=messages, prompt=prompt)
                    continue
                fragments = prompt_fragments(entry, kind=kind, messages=messages, prompt=prompt)
                payload = job_payload_build(
                    job_id=1,
                    model=entry.name,
                    kind=kind,
                    messages=messages,
                    prompt=prompt,
                    inputs=None,
                    params={"max_tokens": 8},
                    fmt=chat_format(entry),
                )
                fed = tokenizer.tokens(payload)
                assert prompt_count(entry, fragments) == len(fed), (family, messages or prompt)
                written = sum(1 for _, control in fragments if control)
                assert sum(1 for token in fed if token in controls) == written, (family, messages or prompt, fragments)
                checked += 1
            assert checked >= len(jobs) - 3
        finally:
            host.close()

    @pytest.mark.parametrize("family", list(FAMILIES))
    def test_a_continuation_ends_on_the_delivered_texts_last_character(self, family_files, var_dir, family) -> None:
        entry = catalog_model_add(
            path=family_files[family], name=f"tiny-{family}", input_price="0.1", output_price="0.4"
        )
        for delivered in ("One, two, th", "Ends in spaces   ", "象は大き"):
            fragments = prompt_fragments(
                entry,
                kind=CHAT,
                prompt=None,
                messages=[{"role": "user", "content": "Go on."}, {"role": "assistant", "content": delivered}],
            )
            assert fragments[-1][1] is False and fragments[-1][0].endswith(delivered), (family, fragments[-2:])

    @pytest.mark.parametrize("family", list(FAMILIES))
    def test_its_stops_and_format_come_from_its_own_file(self, family_files, var_dir, family) -> None:
        entry = catalog_model_add(
            path=family_files[family], name=f"tiny-{family}", input_price="0.1", output_price="0.4"
        )
        expected = {
            "llama3": "<|eot_id|>",
            "qwen2.5": "<|im_end|>",
            "qwen3": "<|im_end|>",
            "phi3": "<|end|>",
            "mistral": "</s>",
            "gemma": "<end_of_turn>",
        }[family]
        assert entry.end_of_turn == [expected]
        assert entry.bos_text in ("", *entry.control_tokens)
        host = load_llama(family_files[family], n_ctx=64, threads=1)
        try:  # read once when added: the most a host writes for one token (Llama 3's 128 spaces, whole)
            assert entry.longest_token_chars == max(
                len(host.detokenize([t]).decode("utf-8", "replace")) for t in range(host.n_vocab())
            )
        finally:
            host.close()


class ShippedEntryTests:
    """The shipped Gemma entry is an ordinary one: its facts are what catalog_add reads from the
    shipped file with the shipped template (the seed writes them so a fresh database needs no file)."""

    def test_its_facts_are_what_its_file_and_template_say(self) -> None:
        from catalog.gguf_file import gguf_facts
        from catalog.seed import SHIPPED_MODELS
        from catalog.tokenizer import shipped_model_path, tokenizer_for
        from protocol.rendering import chat_format_read

        seed = SHIPPED_MODELS[0]
        facts = gguf_facts(Path(shipped_model_path()))
        adds_bos = tokenizer_for(seed["tokenizer"]).count("", special=True) == 1  # llama.cpp's own answer
        fmt = chat_format_read(
            template=seed["chat_template"],
            bos_token=facts.bos_text,
            eos_token=facts.eos_text,
            adds_bos=adds_bos,
            vocabulary_controls=facts.controls,
        )
        assert fmt.adds_bos == seed["adds_bos"]
        assert (set(fmt.controls), list(fmt.end_of_turn)) == (set(seed["control_tokens"]), seed["end_of_turn"])
        assert (facts.bos_text, facts.eos_text, facts.bos_token_id, facts.eos_token_id) == (
            seed["bos_text"],
            seed["eos_text"],
            seed["bos_token_id"],
            seed["eos_token_id"],
        )
        assert (facts.architecture, facts.vocab_size, facts.n_layers, facts.file_size) == (
            seed["architecture"],
            seed["vocab_size"],
            seed["n_layers"],
            seed["file_size"],
        )

    def test_the_migrated_entry_carries_them(self, catalog) -> None:
        from catalog.seed import FACTS, SHIPPED_MODELS

        assert {key: getattr(catalog, key) for key in FACTS} == {key: SHIPPED_MODELS[0][key] for key in FACTS}
