"""Ring layouts and plans point at CatalogModel in its new app (the same table)."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ('catalog', '0001_initial'),
        ('mesh', '0004_moe'),
    ]

    operations = [
        # The table stays where it is; only Django's idea of which app owns the model moves.
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name='modellayout',
                    name='model',
                    field=models.OneToOneField(
                        on_delete=django.db.models.deletion.CASCADE, related_name='layout', to='catalog.catalogmodel'
                    ),
                ),
                migrations.AlterField(
                    model_name='ringplan',
                    name='model',
                    field=models.ForeignKey(
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name='ring_plans',
                        to='catalog.catalogmodel',
                    ),
                ),
            ],
        ),
    ]
