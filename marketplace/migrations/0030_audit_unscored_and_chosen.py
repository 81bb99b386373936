import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ('hosts', '0011_host_allowance'),
        ('marketplace', '0029_job_single_machine_dropped'),
    ]

    operations = [
        migrations.AddField(
            model_name='audit',
            name='chosen',
            field=models.ForeignKey(
                blank=True,
                help_text='the scorer the gateway chose to break a pass/fail split: only it may claim the audit',
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name='+',
                to='hosts.host',
            ),
        ),
        migrations.AddField(
            model_name='audit',
            name='chosen_at',
            field=models.DateTimeField(
                blank=True, help_text='when it was chosen (another is chosen if it is silent)', null=True
            ),
        ),
        migrations.AlterField(
            model_name='audit',
            name='status',
            field=models.CharField(
                choices=[
                    ('pending', 'Pending'),
                    ('passed', 'Passed'),
                    ('failed', 'failed (the customer was refunded, the host put in maintenance)'),
                    (
                        'unscored',
                        (
                            'unscored (nobody independent could read it: the '
                            'customer was refunded, the host not paid nor blamed)'
                        ),
                    ),
                ],
                default='pending',
                max_length=16,
            ),
        ),
    ]
