"""Hold.api_key points at ApiKey in its new app (the same table)."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ('accounts', '0001_initial'),
        ('billing', '0003_topups_payouts'),
    ]

    operations = [
        # The table stays where it is; only Django's idea of which app owns the model moves.
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name='hold',
                    name='api_key',
                    field=models.ForeignKey(
                        on_delete=django.db.models.deletion.PROTECT, related_name='holds', to='accounts.apikey'
                    ),
                ),
            ],
        ),
    ]
