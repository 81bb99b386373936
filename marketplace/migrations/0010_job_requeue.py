"""A death before the first token puts the attempt back in the queue (seed 001); the constraint
allows one job per (attempt, requeue)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ('catalog', '0001_initial'),
        ('hosts', '0006_host_socket_since'),
        ('marketplace', '0009_text_chunks'),
    ]

    operations = [
        migrations.RemoveConstraint(
            model_name='job',
            name='one_job_per_attempt',
        ),
        migrations.AddField(
            model_name='job',
            name='requeue',
            field=models.PositiveSmallIntegerField(
                default=0,
                help_text='times this attempt went back to the queue because its host died before its first token',
            ),
        ),
        migrations.AlterField(
            model_name='job',
            name='attempt',
            field=models.PositiveSmallIntegerField(
                default=1, help_text='1, or 2 for the continuation after a death mid-answer'
            ),
        ),
        migrations.AddConstraint(
            model_name='job',
            constraint=models.UniqueConstraint(
                fields=('request', 'attempt', 'requeue'), name='one_job_per_attempt_and_requeue'
            ),
        ),
    ]
