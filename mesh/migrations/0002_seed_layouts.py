from __future__ import annotations

from django.db import migrations


def seed(apps, schema_editor):  # type: ignore[no-untyped-def]
    from mesh.rings.layouts import layout_seed

    layout_seed(apps.get_model("marketplace", "CatalogModel"), apps.get_model("mesh", "ModelLayout"))


class Migration(migrations.Migration):
    dependencies = [("mesh", "0001_initial"), ("marketplace", "0002_seed_catalog")]
    operations = [migrations.RunPython(seed, migrations.RunPython.noop)]
