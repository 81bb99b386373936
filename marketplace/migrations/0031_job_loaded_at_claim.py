from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ('marketplace', '0030_audit_unscored_and_chosen'),
    ]

    operations = [
        migrations.AddField(
            model_name='job',
            name='loaded_at_claim',
            field=models.BooleanField(
                default=False,
                help_text=(
                    "its host's fresh catalog said the model was loaded when it claimed: "
                    "its start bound is a prefill, not a load (`watchdog.job_start_bounds`)"
                ),
            ),
        ),
    ]
