from __future__ import annotations

from django.db import migrations


def seed(apps, schema_editor):  # type: ignore[no-untyped-def]
    from catalog.seed import catalog_seed

    catalog_seed(apps.get_model("marketplace", "CatalogModel"))  # adds the embeddings model; existing rows untouched


class Migration(migrations.Migration):
    dependencies = [("marketplace", "0006_routing_embeddings")]
    operations = [migrations.RunPython(seed, migrations.RunPython.noop)]
