"""The gateway's vocabulary copy keeps only the BPE merges llama.cpp can apply, and tokenizes
every text exactly as the whole file does: on hand-made merge lists whose outcome is worked out
by hand, and on Llama 3's and Qwen 2's real vocabularies against llama.cpp itself, over the
corpus, texts spliced from the vocabulary's own tokens, and random text in many scripts."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from catalog.bpe_merges import merges_applicable
from catalog.gguf_file import gguf_facts, gguf_vocab_copy
from engine.gguf_meta import _PlainArrayReader, gguf_field
from testkit.corpus import CHATS, COMPLETIONS


class MergeListTests:
    def test_a_split_its_text_never_reaches_is_dropped(self) -> None:
        # "abc" alone: (a, b) ranks 0, below (b, c) at 1, so ab forms first and (ab, c) is its
        # last merge; (a, bc) could only apply to a span that is [a, bc], which never forms.
        merges = [b"a b", b"b c", b"ab c", b"a bc"]
        assert merges_applicable(merges) == [b"a b", b"b c", b"ab c"]

    def test_of_equal_ranks_the_leftmost_merges_first(self) -> None:
        # "aaa" alone: (a, a) at both places, the left one first, so [aa, a] and then (aa, a).
        assert merges_applicable([b"a a", b"a aa", b"aa a"]) == [b"a a", b"aa a"]

    def test_a_repeated_pair_keeps_its_first_rank_only(self) -> None:
        assert merges_applicable([b"x y", b"p q", b"x y"]) == [b"x y", b"p q"]

    def test_an_entry_llama_cpp_reads_as_no_pair_is_kept_as_it_is(self) -> None:
        assert merges_applicable([b"nospace", b"a b"]) == [b"nospace", b"a b"]

    def test_an_entry_ends_at_a_nul_byte_as_llama_cpp_reads_it(self) -> None:
        # llama.cpp reads "a b\0z" as the pair (a, b) at rank 0: the later "a b" is its repeat.
        assert merges_applicable([b"a b\0z", b"b c", b"a b", b"ab c"]) == [b"a b\0z", b"b c", b"ab c"]

    def test_multibyte_characters_are_single_symbols(self) -> None:
        # "é" is two bytes but one starting symbol: a merge inside it could never apply.
        e_acute = "é".encode()
        merges = [e_acute[:1] + b" " + e_acute[1:], "a é".encode()]
        assert merges_applicable(merges) == ["a é".encode()]


def _texts(vocabulary: list[str], seed: int) -> list[str]:
    """The corpus, and texts a BPE has to merge its way through: runs of the vocabulary's own
    tokens spliced together (cut mid-token too), and random characters of many scripts."""
    rng = random.Random(seed)
    corpus = [
        part["text"] if isinstance(part, dict) else part
        for chat in CHATS
        for message in chat
        for part in (message["content"] if isinstance(message["content"], list) else [message["content"]])
    ]
    pieces = [text.replace("Ġ", " ").replace("Ċ", "\n") for text in vocabulary if text and not text.startswith("<")]
    scripts = [
        (0x20, 0x7E),
        (0xA0, 0x24F),
        (0x370, 0x3FF),
        (0x400, 0x4FF),
        (0x590, 0x6FF),
        (0x900, 0x97F),
        (0xE00, 0xE7F),
        (0x3040, 0x30FF),
        (0x4E00, 0x9FFF),
        (0xAC00, 0xD7A3),
        (0x1F300, 0x1FAFF),
    ]
    texts = [*corpus, *COMPLETIONS]
    for _ in range(1500):
        spliced = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))
        texts.append(spliced[rng.randint(0, 2) :])
    for _ in range(500):
        low, high = rng.choice(scripts)
        texts.append(
            "".join(
                chr(rng.randint(low, high)) if rng.random() > 0.2 else rng.choice(" \n\t0123456789")
                for _ in range(rng.randint(1, 40))
            )
        )
    return texts


@pytest.mark.parametrize("family", ["llama3", "qwen2.5"])
def test_the_copy_tokenizes_every_text_as_the_whole_file(
    family_files: dict[str, Path], tmp_path: Path, family: str
) -> None:
    from llama_cpp import Llama

    path = family_files[family]
    copy = tmp_path / "vocab.gguf"
    gguf_vocab_copy(path, gguf_facts(path), copy)
    full_merges = len(gguf_field(_PlainArrayReader(str(path)), "tokenizer.ggml.merges"))
    kept_merges = len(gguf_field(_PlainArrayReader(str(copy)), "tokenizer.ggml.merges"))
    if family == "llama3":  # converted from tiktoken: every split of each token is listed
        assert kept_merges < full_merges / 2, (kept_merges, full_merges)
    else:  # a trained BPE: each merge made a token, and each one applies
        assert kept_merges == full_merges, (kept_merges, full_merges)

    texts = _texts(gguf_field(_PlainArrayReader(str(path)), "tokenizer.ggml.tokens"), seed=len(family))
    whole = Llama(model_path=str(path), vocab_only=True, verbose=False)
    counted = Llama(model_path=str(copy), vocab_only=True, verbose=False)
    try:
        for text in texts:
            data = text.encode()
            for special in (False, True):
                assert counted.tokenize(data, add_bos=False, special=special) == whole.tokenize(
                    data, add_bos=False, special=special
                ), (family, text, special)
    finally:
        whole.close()
        counted.close()


@pytest.mark.django_db
def test_copies_written_before_keep_every_merge_until_the_migration_rewrites_them(
    family_files: dict[str, Path],
    var_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib

    from django.apps import apps

    from catalog import gguf_file
    from catalog.services import catalog_model_add
    from catalog.tokenizer import GGUF_SPEC

    with monkeypatch.context() as before:  # a copy as catalog_add wrote them before: every merge
        before.setattr(gguf_file, "merges_applicable", list)
        entry = catalog_model_add(
            path=family_files["llama3"], name="tiny-llama3", input_price="0.1", output_price="0.4"
        )
    copy = var_dir / entry.tokenizer.removeprefix(GGUF_SPEC)
    merges = len(gguf_field(_PlainArrayReader(str(family_files["llama3"])), "tokenizer.ggml.merges"))
    assert len(gguf_field(_PlainArrayReader(str(copy)), "tokenizer.ggml.merges")) == merges

    migration = importlib.import_module("catalog.migrations.0009_vocabulary_copies_keep_applicable_merges")
    migration.copies_rewrite(apps, None)
    assert len(gguf_field(_PlainArrayReader(str(copy)), "tokenizer.ggml.merges")) < merges / 2
