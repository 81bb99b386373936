from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("mesh", "0002_seed_layouts")]

    operations = [
        migrations.AddField(
            model_name="ringstage",
            name="address",
            field=models.CharField(
                blank=True,
                default="",
                max_length=300,
                help_text="HOST:PORT the stage's agent listens on, as it last reported (its upstream dials it)",
            ),
        ),
        migrations.AddField(
            model_name="ringstage",
            name="address_reported_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
