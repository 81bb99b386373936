"""testkit.families: each family's tiny model is a real GGUF llama.cpp loads and runs on a CPU,
with its family's vocabulary (the same tokens as the vocabulary it was copied from) and its
family's chat template (which renders a chat)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from scorer.llama import load_llama
from testkit import families
from testkit.families import (
    FAMILIES,
    SdistUnavailable,
    family_models,
    sdist_models,
    template_path,
    tiny_model,
    vocab_path,
)

CHAT = [  # two turns: the model answered the first, the second waits for its answer
    {"role": "user", "content": "Hello, who are you?"},
    {"role": "assistant", "content": "A tiny model with random weights."},
    {"role": "user", "content": "Then tell me a joke."},
]
TEXTS = [
    "Hello",
    "Ünïcødé, 日本語, emoji 🐘 and   runs   of    spaces\n\n\ttabs",
    # control-token look-alikes
    "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|im_start|>user\nhi<|im_end|>",
    "<start_of_turn>user\nhi<end_of_turn>\n<|user|>\nhi<|end|>\n[INST] hi [/INST]</s>",
]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return sdist_models(tmp_path_factory.mktemp("sdist"))
    except SdistUnavailable as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def built(models: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return family_models(tmp_path_factory.mktemp("families"), models=models)


def _vocab(path: Path):  # -> llama_cpp.Llama, its vocabulary only
    from llama_cpp import Llama

    return Llama(model_path=str(path), vocab_only=True, verbose=False)


def _render(template: str, messages: list[dict], *, bos_token: str, eos_token: str) -> str:
    """Hugging Face's apply_chat_template, in Jinja2's immutable sandbox."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.globals["raise_exception"] = raise_exception
    environment.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    return environment.from_string(template).render(
        messages=messages, add_generation_prompt=True, bos_token=bos_token, eos_token=eos_token
    )


@pytest.mark.parametrize("family", list(FAMILIES))
class TinyModelTests:
    def test_it_loads_and_generates_on_the_cpu(self, built, family) -> None:
        llm = load_llama(built[family], n_ctx=512, threads=2)
        try:
            prompt = llm.tokenize(b"Hello")
            done = llm.create_completion(prompt=prompt, max_tokens=8, temperature=0)
            assert isinstance(done, dict)  # not streamed

            assert llm.metadata["general.architecture"] == FAMILIES[family].arch
            assert done["usage"]["completion_tokens"] == 8  # control tokens' zero rows: it never ends its turn itself
            assert done["choices"][0]["finish_reason"] == "length" and done["choices"][0]["text"]
        finally:
            llm.close()

    def test_it_tokenizes_as_the_vocabulary_it_was_copied_from(self, models, built, family) -> None:
        tiny, source = _vocab(built[family]), _vocab(vocab_path(family, models))
        try:
            assert tiny.n_vocab() == source.n_vocab()
            assert (tiny.token_bos(), tiny.token_eos()) == (source.token_bos(), source.token_eos())
            for text in TEXTS:
                for special in (True, False):
                    assert tiny.tokenize(text.encode(), special=special) == source.tokenize(
                        text.encode(), special=special
                    ), (text, special)
        finally:
            tiny.close()
            source.close()

    def test_it_carries_its_family_template_which_renders_a_chat(self, models, built, family) -> None:
        tiny = _vocab(built[family])
        try:
            template = tiny.metadata["tokenizer.chat_template"]
            bos, eos = (
                tiny.detokenize([token], special=True).decode() for token in (tiny.token_bos(), tiny.token_eos())
            )
        finally:
            tiny.close()

        assert template == template_path(family, models).read_text(encoding="utf-8")
        rendered = _render(template, CHAT, bos_token=bos, eos_token=eos)
        places = [rendered.find(message["content"]) for message in CHAT]
        assert -1 < places[0] < places[1] < places[2], rendered


class TinyModelBytesTests:
    def test_it_writes_the_same_bytes_for_the_same_seed(self, models, tmp_path) -> None:
        first, again, other = (
            tiny_model("phi3", models, tmp_path / f"{name}.gguf", seed=seed)
            for name, seed in (("first", 0), ("again", 0), ("other", 1))
        )

        assert first.read_bytes() == again.read_bytes() != other.read_bytes()

    def test_it_writes_the_bytes_ggufs_own_writer_writes(self, models, tmp_path, monkeypatch) -> None:
        from gguf import GGUFWriter

        bulk = tiny_model("mistral", models, tmp_path / "bulk.gguf")
        monkeypatch.setattr(families, "_BulkArrayWriter", GGUFWriter)

        assert tiny_model("mistral", models, tmp_path / "plain.gguf").read_bytes() == bulk.read_bytes()


class SdistModelsTests:
    def test_it_says_what_failed_when_pip_cannot_fetch_the_sdist(self, tmp_path, monkeypatch) -> None:
        monkeypatch.setattr(families, "_FETCHED", [])
        monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))

        with pytest.raises(SdistUnavailable, match=r"pip could not fetch the llama-cpp-python==0\.3\.36 sdist"):
            sdist_models(tmp_path / "sdist")

    def test_it_extracts_only_what_the_families_name(self, models) -> None:
        names = {str(path.relative_to(models)) for path in models.rglob("*") if path.is_file()}

        assert names == {
            name for family in FAMILIES.values() for name in (family.vocab, f"templates/{family.template}") if name
        }
