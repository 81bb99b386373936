"""A chat entry sells at most the context its verifiers and runners take (4,096 tokens,
`protocol.catalog.AUDITABLE_CONTEXT_TOKENS` when this was written): entries `catalog_add` made
before with the file's own context (8k and more) are capped, so /v1/models says what admission
holds (`CatalogModel.context_sold`). Embedding entries keep theirs; the old value is not kept
(going back leaves the cap)."""

from django.db import migrations

AUDITABLE_CONTEXT_TOKENS = 4096  # (frozen here: a migration never follows a later change of the constant)


def contexts_cap(apps, schema_editor) -> None:  # noqa: ANN001 (Django's migration signature)
    apps.get_model("catalog", "CatalogModel").objects.filter(
        kind="chat", context_length__gt=AUDITABLE_CONTEXT_TOKENS
    ).update(context_length=AUDITABLE_CONTEXT_TOKENS)


class Migration(migrations.Migration):
    dependencies = [
        ("catalog", "0009_vocabulary_copies_keep_applicable_merges"),
    ]

    operations = [
        migrations.RunPython(contexts_cap, migrations.RunPython.noop),
    ]
