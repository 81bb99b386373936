"""The coordinator's slot with a real vocabulary (the tiny Qwen 3 MoE's, 151,936 tokens): a
job's prompt is the ids the gateway counts, the model's end of turn stops the answer, and a
character split over tokens is delivered whole. The model's own answers are scripted here
(its random weights never write a control token); mesh/tests/test_moe_vocab_e2e.py runs them.
Mixtral (llama with experts, Mistral's vocabulary) goes on sale the same way."""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from catalog.tokenizer import GgufTokenizer
from mahout.moe.runner import MoeRunner
from protocol.rendering import ChatFormat, chat_fragments
from testkit.formats import file_format

if TYPE_CHECKING:
    from catalog.models import CatalogModel

MESSAGES = [{"role": "user", "content": "Tell me about elephants 🐘"}]


@pytest.fixture(scope="module")
def runner(qwen3moe_file: Path) -> Generator[MoeRunner, None, None]:
    found = MoeRunner(qwen3moe_file, n_slots=1, n_ctx=64)
    yield found
    found.close()


@pytest.fixture(scope="module")
def fmt(qwen3moe_file: Path) -> ChatFormat:
    """How the gateway renders a chat for the file (Qwen's template and control tokens)."""
    return file_format(qwen3moe_file, adds_bos=False)


def _job(fmt: ChatFormat) -> dict:
    """A chat job as the gateway sends it."""
    fragments = [list(fragment) for fragment in chat_fragments(fmt, MESSAGES)]
    return {"fragments": fragments, "end_of_turn": list(fmt.end_of_turn), "params": {"max_tokens": 20}}


def _scripted(monkeypatch: pytest.MonkeyPatch, runner: MoeRunner, ids: list[int]) -> list[list[int]]:
    """The model answers `ids`; returns the prompts it was asked with."""
    asked: list[list[int]] = []

    def answer(prompt_ids: list[int], max_tokens: int, **_sampling: object) -> Generator[int, None, None]:
        asked.append(prompt_ids)
        yield from ids[:max_tokens]

    monkeypatch.setattr(runner, "generate_stream", answer)
    return asked


class RealVocabularySlotTests:
    def test_the_prompt_is_the_gateways_count_and_the_end_of_turn_stops(
        self,
        runner: MoeRunner,
        fmt: ChatFormat,
        qwen3moe_file: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        job = _job(fmt)
        vocabulary = runner.tokenizer
        words = vocabulary.encode("Elephants remember.")
        (end,) = vocabulary.tokenizer.llama.tokenize(job["end_of_turn"][0].encode(), add_bos=False, special=True)
        assert end in vocabulary.stop_ids(job) and end != vocabulary.eos_id
        asked = _scripted(monkeypatch, runner, [*words, end, *words])
        slot = runner.slot()
        assert "".join(slot.stream(job)) == "Elephants remember."
        assert (slot.finish_reason, slot.completion_tokens) == ("stop", len(words) + 1)
        (prompt,) = asked
        counted = GgufTokenizer(str(qwen3moe_file)).count_fragments([tuple(f) for f in job["fragments"]])
        assert len(prompt) == counted < len("".join(text for text, _ in job["fragments"]).encode())
        assert prompt.count(vocabulary.tokenizer.llama.tokenize(b"<|im_start|>", add_bos=False, special=True)[0]) == 2

    def test_a_character_split_over_tokens_is_delivered_whole(
        self,
        runner: MoeRunner,
        fmt: ChatFormat,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        ids = runner.tokenizer.encode("big 🐘")
        assert runner.tokenizer.decode(ids[:-1]).endswith("\ufffd")  # the elephant takes more than one token
        _scripted(monkeypatch, runner, ids)
        slot = runner.slot()
        pieces = list(slot.stream(_job(fmt)))
        assert "".join(pieces) == "big 🐘" and not any("\ufffd" in piece for piece in pieces)
        assert slot.finish_reason == "length"


class MixtralPublishTests:
    @pytest.mark.django_db
    def test_mixtral_goes_on_sale_counted_with_its_own_vocabulary(
        self, catalog: CatalogModel, tmp_path: Path, var_dir: Path
    ) -> None:
        """Mixtral's layout (llama with experts) on Mistral's vocabulary: the market takes its
        real expert counts, the catalog counts with its vocabulary, and the coordinator's
        vocabulary feeds exactly that many ids."""
        from catalog.rendering import chat_format, prompt_fragments
        from catalog.tokenizer import tokenizer_for
        from conftest import make_host
        from mahout.moe.runner import Vocabulary
        from mesh.experts.services import moe_model_publish
        from testkit.families import SdistUnavailable, sdist_models, tiny_model

        try:
            sdist = sdist_models(tmp_path / "sdist")
        except SdistUnavailable as unavailable:
            pytest.skip(str(unavailable))
        path = tiny_model("mixtral", sdist, tmp_path / "mixtral.gguf", n_layer=2)
        model, entry = moe_model_publish(
            name="tiny-mixtral", gguf_path=path, slice_size=4, coordinator=make_host(name="mixtral-rig").host
        )
        assert (model.arch, model.n_layers, model.n_experts, model.n_experts_used) == ("llama", 2, 8, 2)
        assert entry.tokenizer.startswith("gguf:catalog/") and "[INST]" in entry.chat_template
        fragments = prompt_fragments(entry, kind="chat", messages=MESSAGES, prompt=None)
        job = {"fragments": [list(f) for f in fragments], "end_of_turn": list(chat_format(entry).end_of_turn)}
        counted = tokenizer_for(entry.tokenizer).count_fragments(fragments)
        assert len(Vocabulary(path).prompt(job)) == counted < len("".join(text for text, _ in fragments).encode())
