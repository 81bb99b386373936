from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("marketplace", "0004_job_avoid_host"),
    ]

    operations = [
        migrations.AddField(
            model_name="apikey",
            name="rate_limit_per_minute",
            field=models.PositiveIntegerField(
                blank=True, help_text="admissions per rolling minute; empty = unlimited", null=True
            ),
        ),
        migrations.AddField(
            model_name="apikey",
            name="max_concurrent",
            field=models.PositiveIntegerField(
                blank=True, help_text="requests in flight at once; empty = unlimited", null=True
            ),
        ),
    ]
