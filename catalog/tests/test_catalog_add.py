"""`manage.py catalog_add`: a chat model enters the catalog from its own GGUF file.

The inputs are real GGUFs: small files written with the `gguf` package's GGUFWriter that carry
a real model's whole vocabulary (Gemma 3's 262,144 tokens, copied from the shipped file's
metadata) and a few MB of stand-in weights, so the vocabulary copy must be much smaller than
the file and must count exactly as llama.cpp counts with the whole file. Each family hosts run
is a `testkit.families` tiny model: its real vocabulary and template from the llama-cpp-python
sdist, fetched at test time.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from gguf import GGUFValueType, GGUFWriter

from catalog.models import CatalogModel
from catalog.tokenizer import shipped_model_path, tokenizer_for
from engine.gguf_meta import open_gguf
from protocol.catalog import AUDITABLE_CONTEXT_TOKENS
from testkit.families import FAMILIES, SdistUnavailable, sdist_models, template_path, tiny_model

pytestmark = pytest.mark.django_db

TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{{ message['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
END_OF_TURN = 106  # Gemma 3's <end_of_turn>
WEIGHT_FLOATS = 6 * 1024 * 1024  # 24 MB of stand-in weights
TEXTS = [
    "Hello, world!",
    "Ünïcødé, 日本語のテキスト, 中文, emoji 🐘🎉 and   runs   of    spaces\n\n\ttabs",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",  # special-token look-alikes
    "def f(x):\n    return x ** 2  # code",
    "",
]


def _tiny_gguf(dest: Path, *, template: str | None, general_name: str) -> Path:
    """A GGUF with the shipped model's metadata (architecture, vocabulary), `template` as its
    chat template (None: none at all), an end-of-turn id, file type F32 and one tensor of
    stand-in weights."""
    reader = open_gguf(shipped_model_path())
    writer = GGUFWriter(str(dest), reader.fields["general.architecture"].contents())
    skipped = ("general.architecture", "general.name", "general.file_type", "tokenizer.chat_template")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in skipped:
            continue
        kind = field.types[0]
        writer.add_key_value(
            key, field.contents(), kind, sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None
        )
    writer.add_name(general_name)
    writer.add_file_type(0)  # ALL_F32
    writer.add_eot_token_id(END_OF_TURN)
    if template is not None:
        writer.add_chat_template(template)
    import numpy as np

    writer.add_tensor("token_embd.weight", np.zeros(WEIGHT_FLOATS, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The model files every test adds or is refused: built once (the vocabulary takes seconds)."""
    folder = tmp_path_factory.mktemp("gguf")
    (folder / "not-a-model.gguf").write_bytes(b"this is plain text, not a GGUF file\n" * 10)
    (folder / "template.jinja").write_text(TEMPLATE)
    return {
        "chat": _tiny_gguf(folder / "chat.gguf", template=TEMPLATE, general_name="tiny chat"),
        "base": _tiny_gguf(folder / "base.gguf", template=None, general_name="tiny chat"),
        "not_gguf": folder / "not-a-model.gguf",
        "template": folder / "template.jinja",
    }


@pytest.fixture(scope="module")
def sdist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llama.cpp's published vocabularies and templates (test data fetched now, never committed);
    the tests that need them skip, saying why, without them."""
    try:
        return sdist_models(tmp_path_factory.mktemp("sdist"))
    except SdistUnavailable as error:
        pytest.skip(str(error))


def _add(
    path: Path, name: str = "tiny-chat", input_price: str = "0.10", output_price: str = "0.40", *extra: str
) -> None:
    call_command(
        "catalog_add", str(path), "--name", name, "--input-price", input_price, "--output-price", output_price, *extra
    )


class CatalogAddTests:
    def test_it_adds_a_chat_model_with_the_facts_of_its_own_file(self, files, var_dir) -> None:
        _add(files["chat"])

        entry = CatalogModel.objects.get(name="tiny-chat")
        assert entry.kind == CatalogModel.Kind.CHAT and entry.active
        assert (entry.architecture, entry.n_layers, entry.n_experts) == ("gemma3", 18, None)
        assert entry.context_length == AUDITABLE_CONTEXT_TOKENS == 4096  # of the file's 32,768: what audits read
        assert entry.chat_template == TEMPLATE
        assert (entry.bos_token_id, entry.eos_token_id, entry.eot_token_id) == (2, 1, END_OF_TURN)
        assert entry.vocab_size == 262_144
        assert entry.quantization == "F32"
        assert entry.file_size == files["chat"].stat().st_size
        assert entry.sha256 == hashlib.sha256(files["chat"].read_bytes()).hexdigest()
        assert (entry.input_price_ucents, entry.output_price_ucents) == (10, 40)  # $0.10 and $0.40 per million

    def test_it_keeps_a_vocabulary_copy_much_smaller_than_the_file(self, files, var_dir) -> None:
        _add(files["chat"])

        entry = CatalogModel.objects.get(name="tiny-chat")
        assert entry.tokenizer.startswith("gguf:catalog/vocab-") and entry.tokenizer.endswith(".gguf")
        copy = var_dir / entry.tokenizer.removeprefix("gguf:")
        assert copy.stat().st_size < 10_000_000 < 4 * copy.stat().st_size < entry.file_size
        assert os.listdir(var_dir / "catalog") == [copy.name]  # nothing partial left beside it

    def test_files_that_tokenize_alike_share_one_vocabulary_copy(self, files, var_dir) -> None:
        _add(files["chat"])
        _add(files["base"], "tiny-base", "0.10", "0.40", "--template", str(files["template"]))

        chat, base = CatalogModel.objects.get(name="tiny-chat"), CatalogModel.objects.get(name="tiny-base")
        assert chat.sha256 != base.sha256  # other files (no template inside)...
        assert chat.tokenizer == base.tokenizer  # ...the same vocabulary: one copy, loaded once per gateway process
        assert tokenizer_for(chat.tokenizer) is tokenizer_for(base.tokenizer)
        assert os.listdir(var_dir / "catalog") == [chat.tokenizer.removeprefix("gguf:catalog/")]

    def test_another_vocabulary_gets_its_own_copy(self, files, sdist, tmp_path, var_dir) -> None:
        _add(files["chat"])
        family = tiny_model("qwen3", sdist, tmp_path / "qwen3.gguf")
        _add(family, "tiny-qwen3", "0.10", "0.40", "--template", str(template_path("qwen3", sdist)))

        chat, qwen = CatalogModel.objects.get(name="tiny-chat"), CatalogModel.objects.get(name="tiny-qwen3")
        assert chat.tokenizer != qwen.tokenizer
        assert len(os.listdir(var_dir / "catalog")) == 2
        assert tokenizer_for(qwen.tokenizer) is not tokenizer_for(chat.tokenizer)

    def test_one_vocabulary_under_a_name_llama_cpp_reads_apart_gets_its_own_copy(
        self, sdist, tmp_path, var_dir
    ) -> None:
        """llama.cpp gives Phi-3's markers the newline after them only in a file named phi-3 or
        phi3: the same vocabulary renamed counts a chat in more tokens, so it gets a copy of its
        own, and each entry counts as llama.cpp counts with its own file (whichever a process
        loaded first)."""
        from llama_cpp import Llama

        from catalog.rendering import chat_format, prompt_count, prompt_fragments
        from protocol.rendering import fragments_text

        named = tiny_model("phi3", sdist, tmp_path / "named.gguf")
        renamed = tiny_model("phi3", sdist, tmp_path / "renamed.gguf", name="tiny model")
        _add(named, "phi-named")
        _add(renamed, "phi-renamed")

        entries = {
            path: CatalogModel.objects.get(name=name) for path, name in ((named, "phi-named"), (renamed, "phi-renamed"))
        }
        assert entries[named].tokenizer != entries[renamed].tokenizer
        assert "<|end|>" in chat_format(entries[named]).rstrip and "<|end|>" not in chat_format(entries[renamed]).rstrip
        chat = [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Rivers:\n\n"},
        ]
        counts = {}
        for path, entry in entries.items():
            fragments = prompt_fragments(entry, kind="chat", messages=chat, prompt=None)
            whole = Llama(model_path=str(path), vocab_only=True, verbose=False)
            try:
                expected = len(whole.tokenize(fragments_text(fragments).encode(), add_bos=False, special=True))
            finally:
                whole.close()
            counts[path] = prompt_count(entry, fragments)
            assert counts[path] == expected, path.name
        assert counts[named] < counts[renamed]

    def test_it_counts_with_the_copy_exactly_as_llama_cpp_counts_with_the_whole_file(self, files, var_dir) -> None:
        from llama_cpp import Llama

        _add(files["chat"])
        counter = tokenizer_for(CatalogModel.objects.get(name="tiny-chat").tokenizer)
        whole = Llama(model_path=str(files["chat"]), vocab_only=True, verbose=False)
        try:
            assert counter.exact
            for text in TEXTS:
                for special in (True, False):
                    expected = len(whole.tokenize(text.encode(), add_bos=special, special=special))
                    assert counter.count(text, special=special) == expected, (text, special)
            assert counter.count(TEXTS[1], special=False) < len(TEXTS[1].encode())  # tokens, not bytes
        finally:
            whole.close()

    def test_it_takes_the_template_from_a_file_when_the_model_has_none(self, files, var_dir) -> None:
        _add(files["base"], "tiny-base", "0", "1.5", "--template", str(files["template"]))

        entry = CatalogModel.objects.get(name="tiny-base")
        assert entry.chat_template == TEMPLATE
        assert (entry.input_price_ucents, entry.output_price_ucents) == (0, 150)

    def test_it_sells_less_context_than_the_file_when_told(self, files, var_dir) -> None:
        _add(files["chat"], "tiny-chat", "0.10", "0.40", "--context-length", "2048")

        assert CatalogModel.objects.get(name="tiny-chat").context_length == 2048

    def test_it_leaves_the_shipped_entries_as_they_were(self, files, var_dir) -> None:
        before = list(CatalogModel.objects.order_by("name").values())
        _add(files["chat"])

        assert list(CatalogModel.objects.exclude(name="tiny-chat").order_by("name").values()) == before
        assert CatalogModel.objects.get(name="gemma-3-270m").tokenizer == "shipped:gemma-3-270m"


class CatalogAddFamilyTests:
    """Each family's tiny model (its real vocabulary, byte-level BPE or SentencePiece, and its
    template): added with its own facts, counted as llama.cpp counts it. Gemma's vocabulary is
    the shipped model's, counted above; Qwen 3's is Qwen 2.5's."""

    @pytest.mark.parametrize("family", ["llama3", "qwen2.5", "phi3", "mistral"])
    def test_it_counts_each_family_exactly_as_llama_cpp_does(self, sdist, tmp_path, var_dir, family) -> None:
        from llama_cpp import Llama

        model = tiny_model(family, sdist, tmp_path / "model.gguf")
        _add(model, "family-model")

        entry = CatalogModel.objects.get(name="family-model")
        whole = Llama(model_path=str(model), vocab_only=True, verbose=False)
        try:
            assert entry.architecture == FAMILIES[family].arch
            assert (entry.vocab_size, entry.bos_token_id) == (whole.n_vocab(), whole.token_bos())
            assert entry.chat_template == template_path(family, sdist).read_text(encoding="utf-8")
            counter = tokenizer_for(entry.tokenizer)
            for text in TEXTS:
                for special in (True, False):
                    expected = len(whole.tokenize(text.encode(), add_bos=special, special=special))
                    assert counter.count(text, special=special) == expected, (family, text, special)
        finally:
            whole.close()


class CatalogAddRefusalTests:
    """Each refusal: exit code 2, one line that says why, and nothing written."""

    def _refused(self, var_dir: Path, *args: object) -> str:
        rows = CatalogModel.objects.count()
        with pytest.raises(CommandError) as refused:
            _add(*args)  # type: ignore[arg-type]
        assert refused.value.returncode == 2
        message = str(refused.value)
        assert message and "\n" not in message
        assert CatalogModel.objects.count() == rows
        assert not (var_dir / "catalog").exists() or not any((var_dir / "catalog").iterdir())
        return message

    def test_it_refuses_a_missing_file(self, files, var_dir) -> None:
        assert "no such file" in self._refused(var_dir, files["chat"].with_name("absent.gguf"))

    def test_it_refuses_a_file_that_is_not_a_gguf(self, files, var_dir) -> None:
        assert "not a GGUF file" in self._refused(var_dir, files["not_gguf"])

    def test_it_refuses_a_model_without_a_chat_template_and_names_the_option(self, files, var_dir) -> None:
        message = self._refused(var_dir, files["base"], "tiny-base")
        assert "no chat template" in message and "--template FILE" in message

    def test_it_refuses_a_name_already_in_the_catalog(self, files, var_dir) -> None:
        assert "gemma-3-270m is already in the catalog" in self._refused(var_dir, files["chat"], "gemma-3-270m")

    def test_it_refuses_a_file_already_in_the_catalog(self, files, var_dir) -> None:
        _add(files["chat"])
        copies = sorted((var_dir / "catalog").iterdir())
        rows = CatalogModel.objects.count()

        with pytest.raises(CommandError) as refused:
            _add(files["chat"], "tiny-chat-again")
        assert refused.value.returncode == 2 and "already in the catalog as tiny-chat" in str(refused.value)
        assert CatalogModel.objects.count() == rows
        assert sorted((var_dir / "catalog").iterdir()) == copies  # the first entry keeps its copy

    @pytest.mark.parametrize(
        ("input_price", "output_price", "says"),
        [
            ("abc", "0.40", "is not a number"),
            ("0.10", "-1", "not a non-negative number"),
            ("0.10", "NaN", "not a non-negative number"),
            ("0.105", "0.40", "not a whole number of µ¢"),
        ],
    )
    def test_it_refuses_a_bad_price(self, files, var_dir, input_price, output_price, says) -> None:
        assert says in self._refused(var_dir, files["chat"], "tiny-chat", input_price, output_price)

    def test_it_refuses_a_bad_name(self, files, var_dir) -> None:
        assert "is not a model name" in self._refused(var_dir, files["chat"], "two words")

    def test_it_refuses_more_context_than_the_file_has(self, files, var_dir) -> None:
        message = self._refused(var_dir, files["chat"], "tiny-chat", "0.1", "0.4", "--context-length", "65536")
        assert "the file's own context is 32768" in message

    def test_it_refuses_more_context_than_audits_read_though_the_file_has_it(self, files, var_dir) -> None:
        """A job longer than the verifiers' context could not be audited (it was paid unchecked):
        such a context is not sold, whatever the file's own."""
        message = self._refused(var_dir, files["chat"], "tiny-chat", "0.1", "0.4", "--context-length", "8192")
        assert "not within 1 and 4096 tokens" in message and "audits and hosts read at most 4096" in message
        assert not CatalogModel.objects.filter(name="tiny-chat").exists()

    def test_it_refuses_an_unreadable_template_file(self, files, var_dir) -> None:
        message = self._refused(
            var_dir,
            files["base"],
            "tiny-base",
            "0.1",
            "0.4",
            "--template",
            str(files["template"].with_name("absent.jinja")),
        )
        assert "cannot read the template" in message


class CatalogAddCommandLineTests:
    """As an operator runs it: a real process, its exit code and its stderr."""

    def _run(self, var_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "ELEPHANT_VAR_DIR": str(var_dir)}
        return subprocess.run(
            [sys.executable, "manage.py", "catalog_add", *args],
            cwd=settings.BASE_DIR,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    def test_it_exits_2_with_one_line_for_a_file_that_is_not_a_gguf(self, files, tmp_path) -> None:
        done = self._run(
            tmp_path, str(files["not_gguf"]), "--name", "x", "--input-price", "0.1", "--output-price", "0.4"
        )

        assert done.returncode == 2
        assert len(done.stderr.splitlines()) == 1 and "not a GGUF file" in done.stderr
        assert not (tmp_path / "catalog").exists()

    def test_it_exits_2_with_one_line_for_a_missing_argument(self, files, tmp_path) -> None:
        done = self._run(tmp_path, str(files["chat"]), "--name", "x", "--input-price", "0.1")

        assert done.returncode == 2
        assert len(done.stderr.splitlines()) == 1 and "--output-price" in done.stderr
