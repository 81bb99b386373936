"""Embeddings models record their vector width; the shipped MiniLM's is 384."""

from django.db import migrations, models
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps


def shipped_width(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    from catalog.seed import SHIPPED_MODELS

    CatalogModel = apps.get_model("catalog", "CatalogModel")
    for entry in SHIPPED_MODELS:
        if entry.get("embedding_dimensions"):
            CatalogModel.objects.filter(name=entry["name"], embedding_dimensions__isnull=True).update(
                embedding_dimensions=entry["embedding_dimensions"]
            )


class Migration(migrations.Migration):
    dependencies = [
        ("catalog", "0001_initial"),
        ("marketplace", "0008_catalog_and_keys_moved"),  # the table and its shipped rows exist by then
    ]

    operations = [
        migrations.AddField(
            model_name="catalogmodel",
            name="embedding_dimensions",
            field=models.PositiveIntegerField(
                blank=True, help_text="an embeddings model's vector width: a host's vectors must have it", null=True
            ),
        ),
        migrations.RunPython(shipped_width, migrations.RunPython.noop),
    ]
