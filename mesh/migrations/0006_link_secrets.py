"""Link secrets: one per ring plan, one per expert worker (the handshake of `mahout.link`).

Adding a field with a callable default gives every existing row the same value, so each
row is then given its own."""

import django.db.models.deletion
from django.db import migrations, models

import mesh.linksecret


def each_its_own(apps, schema_editor):
    for name in ("RingPlan", "ExpertWorker"):
        model = apps.get_model("mesh", name)
        for pk in model.objects.values_list("pk", flat=True):
            model.objects.filter(pk=pk).update(secret=mesh.linksecret.link_secret_new())


class Migration(migrations.Migration):
    dependencies = [
        ('hosts', '0007_host_trust'),
        ('mesh', '0005_models_in_catalog'),
    ]

    operations = [
        migrations.AddField(
            model_name='expertworker',
            name='secret',
            field=models.CharField(
                default=mesh.linksecret.link_secret_new,
                editable=False,
                help_text=(
                    "what the coordinator's link to this worker is "
                    "admitted with; its volunteer and the coordinator only"
                ),
                max_length=100,
            ),
        ),
        migrations.AddField(
            model_name='ringplan',
            name='secret',
            field=models.CharField(
                default=mesh.linksecret.link_secret_new,
                editable=False,
                help_text="what the ring's links are admitted with; handed to its stage hosts and its bridge only",
                max_length=100,
            ),
        ),
        migrations.AlterField(
            model_name='expertmodel',
            name='coordinator',
            field=models.ForeignKey(
                blank=True,
                help_text=(
                    'bound by the operator (moe_register --coordinator-host); no other host may report for the model'
                ),
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name='coordinated_moe_models',
                to='hosts.host',
            ),
        ),
        migrations.RunPython(each_its_own, migrations.RunPython.noop),
    ]
