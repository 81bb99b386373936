"""Delivered text becomes appended chunks instead of one column rewritten on every batch.

A request whose text is still kept (in flight, or not yet handed over) keeps it as one chunk.
"""

import django.db.models.deletion
from django.db import migrations, models
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps


def text_to_chunks(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    Request = apps.get_model("marketplace", "Request")
    TextChunk = apps.get_model("marketplace", "TextChunk")
    for request_id, text in Request.objects.exclude(delivered_text="").values_list("pk", "delivered_text").iterator():
        TextChunk.objects.create(request_id=request_id, job=None, seq=0, char_offset=0, text=text)


def chunks_to_text(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    Request = apps.get_model("marketplace", "Request")
    TextChunk = apps.get_model("marketplace", "TextChunk")
    for request_id in TextChunk.objects.values_list("request_id", flat=True).distinct():
        text = "".join(
            TextChunk.objects.filter(request_id=request_id).order_by("char_offset").values_list("text", flat=True)
        )
        Request.objects.filter(pk=request_id).update(delivered_text=text)


class Migration(migrations.Migration):
    dependencies = [
        ('marketplace', '0008_catalog_and_keys_moved'),
    ]

    operations = [
        migrations.AlterField(
            model_name='request',
            name='delivered_chars',
            field=models.PositiveIntegerField(
                default=0, help_text="characters delivered so far: the next chunk's offset"
            ),
        ),
        migrations.CreateModel(
            name='TextChunk',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('seq', models.PositiveIntegerField(help_text="the job's batch number")),
                (
                    'char_offset',
                    models.PositiveIntegerField(help_text="where the text starts in the request's delivered text"),
                ),
                ('text', models.TextField()),
                (
                    'job',
                    models.ForeignKey(
                        null=True,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name='chunks',
                        to='marketplace.job',
                    ),
                ),
                (
                    'request',
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE, related_name='chunks', to='marketplace.request'
                    ),
                ),
            ],
            options={
                'constraints': [
                    models.UniqueConstraint(fields=('request', 'char_offset'), name='one_chunk_per_offset')
                ],
            },
        ),
        migrations.RunPython(text_to_chunks, chunks_to_text),
        migrations.RemoveField(
            model_name='request',
            name='delivered_text',
        ),
    ]
