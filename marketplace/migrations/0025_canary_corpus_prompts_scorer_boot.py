# Canaries of models without references (judged by their audit alone) and the scorer's boot id
# (marketplace.trust.audits, marketplace.lifecycle.canaries).

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ('marketplace', '0024_audit_scored_by_hosts'),
    ]

    operations = [
        migrations.AddField(
            model_name='audit',
            name='scorer_boot',
            field=models.CharField(
                blank=True,
                default='',
                help_text=(
                    "the boot id of the scorer's process that claimed it "
                    "(blank: none sent); a new one from that host frees it"
                ),
                max_length=64,
            ),
        ),
        migrations.AlterField(
            model_name='canarycheck',
            name='reference',
            field=models.ForeignKey(
                blank=True,
                help_text=(
                    'its reference (blank: a corpus prompt for a model without references, judged by its audit alone)'
                ),
                null=True,
                on_delete=django.db.models.deletion.CASCADE,
                related_name='checks',
                to='marketplace.canaryreference',
            ),
        ),
    ]
