from __future__ import annotations

from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps


def seed(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    from mesh.rings.layouts import layout_seed

    layout_seed(apps.get_model("marketplace", "CatalogModel"), apps.get_model("mesh", "ModelLayout"))


class Migration(migrations.Migration):
    dependencies = [("mesh", "0001_initial"), ("marketplace", "0002_seed_catalog")]
    operations = [migrations.RunPython(seed, migrations.RunPython.noop)]
