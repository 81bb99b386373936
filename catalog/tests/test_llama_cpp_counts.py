"""The gateway counts a prompt as llama.cpp does: for every vocabulary llama.cpp publishes with a
chat template (the llama-cpp-python sdist's `ggml-vocab-*.gguf` that hold one), and for the
families' vocabularies paired with their instruct templates, the prompt tokens the gateway
bills (`catalog.rendering`: its rendering, its count with the vocabulary) equal, exactly,
llama.cpp's own tokenization of the same rendering with its special tokens parsed
(`parse_special`), and the tokens a host feeds its model (`PromptTokenizer`).

That is where a control token's `lstrip` / `rstrip` shows: Phi-3's markers take the newline after
them, so counting that newline as text billed a short chat half again and fed the model a prompt
it was never trained on. Conversations whose text holds one of the vocabulary's special tokens
are left out: there the gateway keeps the customer's text plain on purpose, where llama.cpp
would read a control token.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from catalog.models import CatalogModel
from catalog.rendering import chat_format, prompt_count, prompt_fragments
from catalog.tokenizer import tokenizer_for
from engine.gguf_meta import _PlainArrayReader, gguf_field
from protocol.jobs import CHAT, job_payload_build
from protocol.rendering import TemplateRefused, chat_format_read, content_text, fragments_text
from testkit.corpus import CHATS
from testkit.families import SdistUnavailable, sdist_vocabularies

CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type: the types llama.cpp finds in a text it parses
# Vocabularies without a template of their own, with their families' instruct templates (`testkit.families`).
PAIRED = {
    "llama-bpe+3.1": ("ggml-vocab-llama-bpe.gguf", "meta-llama-Llama-3.1-8B-Instruct.jinja"),
    "llama-bpe+3.2": ("ggml-vocab-llama-bpe.gguf", "meta-llama-Llama-3.2-3B-Instruct.jinja"),
    "llama-spm+mistral": ("ggml-vocab-llama-spm.gguf", "mistralai-Mistral-Nemo-Instruct-2407.jinja"),
    "qwen2+qwen3": ("ggml-vocab-qwen2.gguf", "Qwen-Qwen3-0.6B.jinja"),
    "phi-3+3.5": ("ggml-vocab-phi-3.gguf", "microsoft-Phi-3.5-mini-instruct.jinja"),  # Phi-3's own has no system turn
}
SYSTEM_AND_USER = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name three rivers."},
]

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def vocabularies(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return sdist_vocabularies(tmp_path_factory.mktemp("sdist"))
    except SdistUnavailable as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def cases(vocabularies: Path) -> dict[str, tuple[Path, str]]:
    """Every sdist vocabulary that holds a chat template, with it; and the pairs above."""
    found = {}
    for path in sorted(vocabularies.glob("ggml-vocab-*.gguf")):
        if (
            b"tokenizer.chat_template" not in path.read_bytes()
        ):  # (parsing a vocabulary takes seconds: only those with one)
            continue
        template = gguf_field(_PlainArrayReader(str(path)), "tokenizer.chat_template", "")
        if template:
            found[path.name.removeprefix("ggml-vocab-").removesuffix(".gguf")] = (path, template)
    for name, (vocabulary, template) in PAIRED.items():
        found[name] = (vocabularies / vocabulary, (vocabularies / "templates" / template).read_text(encoding="utf-8"))
    return found


def entry(path: Path, template: str) -> tuple[CatalogModel, set[str]]:
    """A catalog entry as `catalog_add` makes it, counting with this vocabulary file (unsaved: the
    gateway renders and counts an entry from these fields), and the vocabulary's special texts."""
    reader = _PlainArrayReader(str(path))
    texts = reader.fields["tokenizer.ggml.tokens"].contents()
    kinds = gguf_field(reader, "tokenizer.ggml.token_type")
    bos, eos = gguf_field(reader, "tokenizer.ggml.bos_token_id"), gguf_field(reader, "tokenizer.ggml.eos_token_id")
    bos_text = texts[bos] if bos is not None else ""
    eos_text = texts[eos] if eos is not None else ""
    model = CatalogModel(
        name=path.stem,
        context_length=1 << 20,
        input_price_ucents=1,
        output_price_ucents=1,
        tokenizer=f"gguf:{path.resolve()}",
    )
    fmt = chat_format_read(
        template=template,
        bos_token=bos_text,
        eos_token=eos_text,
        adds_bos=tokenizer_for(model.tokenizer).count("", special=True) == 1,
        vocabulary_controls=[text for text, kind in zip(texts, kinds, strict=True) if kind == CONTROL],
    )
    model.chat_template, model.bos_text, model.eos_text, model.adds_bos = template, bos_text, eos_text, fmt.adds_bos
    model.control_tokens, model.end_of_turn = list(fmt.controls), list(fmt.end_of_turn)
    special = {text for text, kind in zip(texts, kinds, strict=True) if kind in (CONTROL, USER_DEFINED) and text}
    return model, special


class LlamaCppCountTests:
    def test_every_published_vocabulary_with_a_template_counts_as_llama_cpp_parses_the_rendering(self, cases):
        from llama_cpp import Llama

        from scorer.llama import PromptTokenizer

        assert {"phi-3", "qwen2", "command-r"} <= set(cases)  # what the sdist has published since 0.3.x
        for name, (path, template) in cases.items():
            model, special = entry(path, template)
            llama = Llama(model_path=str(path), vocab_only=True, verbose=False)
            try:
                checked = 0
                for messages in CHATS:
                    if any(text in content_text(m.get("content")) for m in messages for text in special):
                        continue
                    try:
                        fragments = prompt_fragments(model, kind=CHAT, messages=messages, prompt=None)
                    except TemplateRefused:  # (a template without a system role, or that cannot continue)
                        continue
                    parsed = llama.tokenize(fragments_text(fragments).encode(), add_bos=False, special=True)
                    billed = prompt_count(model, fragments)
                    assert billed == len(parsed), (name, messages, fragments)
                    payload = job_payload_build(
                        job_id=1,
                        model=model.name,
                        kind=CHAT,
                        messages=messages,
                        prompt=None,
                        inputs=None,
                        params={"max_tokens": 8},
                        fmt=chat_format(model),
                    )
                    assert PromptTokenizer(llama).tokens(payload) == parsed, (name, messages)
                    checked += 1
                assert checked >= 5, (name, checked)
            finally:
                llama.close()

    def test_phi_3s_markers_take_the_newline_after_them(self, cases):
        model, _ = entry(*cases["phi-3+3.5"])
        assert set(chat_format(model).rstrip) >= {"<|system|>", "<|user|>", "<|assistant|>", "<|end|>"}
        fragments = prompt_fragments(model, kind=CHAT, messages=SYSTEM_AND_USER, prompt=None)
        assert fragments_text(fragments) == (
            "<s><|system|>You are a terse assistant.<|end|><|user|>Name three rivers.<|end|><|assistant|>"
        )
        vocabulary = tokenizer_for(model.tokenizer)
        texts = sum(vocabulary.count(m["content"], special=False) for m in SYSTEM_AND_USER)
        assert prompt_count(model, fragments) == 1 + 5 + texts  # BOS, five markers, the texts: no newline counted
