"""Qualification.model points at CatalogModel in its new app (the same table)."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ('catalog', '0001_initial'),
        ('hosts', '0004_host_catalog'),
    ]

    operations = [
        # The table stays where it is; only Django's idea of which app owns the model moves.
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name='qualification',
                    name='model',
                    field=models.ForeignKey(
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name='qualifications',
                        to='catalog.catalogmodel',
                    ),
                ),
            ],
        ),
    ]
