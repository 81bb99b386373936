"""Rewrite the vocabulary copies entries added before copies kept only the BPE merges llama.cpp
can apply (`catalog.bpe_merges`): the same counts, less memory in every gateway process (Llama 3's
50 MB -> 36 MB). An entry whose weights file is no longer where it was added from keeps its copy
(still exact, only larger), and so does one whose file cannot be read or written now: nothing
on disk stops a migrate. Rows are not touched."""

from pathlib import Path

from django.conf import settings
from django.db import migrations

GGUF_SPEC = "gguf:"


def copies_rewrite(apps, schema_editor) -> None:  # noqa: ANN001 (Django's migration signature)
    from catalog.gguf_file import gguf_facts, gguf_vocab_copy

    done: set[Path] = set()
    for tokenizer, weights in (
        apps.get_model("catalog", "CatalogModel")
        .objects.filter(tokenizer__startswith=GGUF_SPEC)
        .exclude(weights_path="")
        .values_list("tokenizer", "weights_path")
    ):
        copy = Path(settings.VAR_DIR) / tokenizer.removeprefix(GGUF_SPEC)
        if copy in done or not copy.is_file() or not Path(weights).is_file():
            continue
        try:
            facts = gguf_facts(Path(weights))
            if copy.name == f"vocab-{facts.vocabulary_sha256}.gguf":  # the copy is this file's vocabulary
                gguf_vocab_copy(Path(weights), facts, copy)
                done.add(copy)
        except Exception:  # noqa: BLE001 (the old copy counts exactly: no file on disk may stop a migrate)
            continue


class Migration(migrations.Migration):
    dependencies = [
        ("catalog", "0008_weights_path"),
    ]

    operations = [
        migrations.RunPython(copies_rewrite, migrations.RunPython.noop),
    ]
