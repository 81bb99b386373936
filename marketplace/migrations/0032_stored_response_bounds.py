from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ('marketplace', '0031_job_loaded_at_claim'),
    ]

    operations = [
        migrations.AddField(
            model_name='storedresponse',
            name='size_bytes',
            field=models.PositiveBigIntegerField(
                default=0,
                help_text='conversation and body as compact UTF-8 JSON: what RESPONSE_STORE_ACCOUNT_MAX_BYTES counts',
            ),
        ),
        migrations.AlterField(
            model_name='storedresponse',
            name='conversation',
            field=models.JSONField(
                help_text=(
                    "the input items (earlier turns first) then the output items, in the Responses "
                    "API's shape, normalised (only what a turn needs); instructions are not carried over"
                )
            ),
        ),
    ]
