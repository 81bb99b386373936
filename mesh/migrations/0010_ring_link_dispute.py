"""Ring links each with their own secret (derived from the plan's, which is no longer handed
out), and disputed links: the two hosts kept apart, neither forfeiting (issue 50)."""

import django.db.models.deletion
from django.db import migrations, models

import mesh.linksecret


class Migration(migrations.Migration):
    dependencies = [
        ('hosts', '0011_host_allowance'),
        ('mesh', '0009_moe_coordinator_uses_workers'),
    ]

    operations = [
        migrations.AlterField(
            model_name='ringplan',
            name='secret',
            field=models.CharField(
                default=mesh.linksecret.link_secret_new,
                editable=False,
                help_text="what each of the ring's link secrets is derived from; never handed out",
                max_length=100,
            ),
        ),
        migrations.CreateModel(
            name='RingLinkDispute',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('upstream_index', models.IntegerField(help_text="the sending stage's index (-1: the bridge)")),
                ('downstream_index', models.PositiveIntegerField()),
                ('reason', models.TextField(blank=True)),
                ('created_at', models.DateTimeField(auto_now_add=True)),
                (
                    'downstream_host',
                    models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='+', to='hosts.host'),
                ),
                (
                    'plan',
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE, related_name='disputes', to='mesh.ringplan'
                    ),
                ),
                (
                    'upstream_host',
                    models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='+', to='hosts.host'),
                ),
            ],
            options={
                'ordering': ['-created_at'],
                'indexes': [
                    models.Index(fields=['upstream_host', 'downstream_host', 'created_at'], name='ring_dispute_pair')
                ],
            },
        ),
    ]
