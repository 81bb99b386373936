# Audits of models whose weights the gateway lacks, scored by trusted hosts (marketplace.trust.audits).

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ('hosts', '0011_host_allowance'),
        ('marketplace', '0023_stored_response'),
    ]

    operations = [
        migrations.AddField(
            model_name='audit',
            name='by_hosts',
            field=models.BooleanField(
                default=False, help_text="scored by trusted hosts paid to score (the gateway lacks the model's weights)"
            ),
        ),
        migrations.AddField(
            model_name='audit',
            name='scorer',
            field=models.ForeignKey(
                blank=True,
                help_text='the trusted host scoring it now (never its own host)',
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name='+',
                to='hosts.host',
            ),
        ),
        migrations.AddField(
            model_name='audit',
            name='scorer_since',
            field=models.DateTimeField(blank=True, help_text='when that scorer claimed it', null=True),
        ),
        migrations.CreateModel(
            name='AuditScore',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                (
                    'verdict',
                    models.CharField(
                        choices=[
                            ('passed', 'Passed'),
                            ('failed', 'Failed'),
                            ('declined', 'declined (it could not score it: another scorer is asked)'),
                            (
                                'abandoned',
                                'abandoned (no verdict within AUDIT_SCORE_TIMEOUT_SECONDS: another scorer is asked)',
                            ),
                        ],
                        max_length=16,
                    ),
                ),
                ('reason', models.CharField(blank=True, max_length=500)),
                ('checked', models.PositiveIntegerField(default=0)),
                ('uncertain', models.PositiveIntegerField(default=0)),
                ('misses', models.PositiveIntegerField(default=0)),
                (
                    'overruled',
                    models.BooleanField(default=False, help_text="a second scorer's confirmation disagreed (a strike)"),
                ),
                (
                    'paid_ucents',
                    models.BigIntegerField(
                        default=0, help_text='its fee for the prefill, paid when the audit was decided'
                    ),
                ),
                ('created_at', models.DateTimeField(auto_now_add=True)),
                (
                    'audit',
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE, related_name='scores', to='marketplace.audit'
                    ),
                ),
                (
                    'scorer',
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.PROTECT, related_name='audit_scores', to='hosts.host'
                    ),
                ),
            ],
            options={
                'indexes': [
                    models.Index(fields=['scorer', 'overruled', 'created_at'], name='marketplace_scorer__d40e5c_idx')
                ],
            },
        ),
    ]
