from __future__ import annotations

from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps


def seed(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    from catalog.seed import catalog_seed

    catalog_seed(apps.get_model("marketplace", "CatalogModel"))  # adds the embeddings model; existing rows untouched


class Migration(migrations.Migration):
    dependencies = [("marketplace", "0006_routing_embeddings")]
    operations = [migrations.RunPython(seed, migrations.RunPython.noop)]
