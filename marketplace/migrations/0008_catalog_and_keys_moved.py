"""CatalogModel and ApiKey leave marketplace for their own apps (catalog, accounts); their tables stay.

The content types follow them, so admin permissions and log entries keep pointing at the
right rows."""

import django.db.models.deletion
from django.db import migrations, models
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps

MOVED = {"catalogmodel": "catalog", "apikey": "accounts"}


def content_types_follow(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    ContentType = apps.get_model("contenttypes", "ContentType")
    for model, app in MOVED.items():
        ContentType.objects.filter(app_label="marketplace", model=model).update(app_label=app)


def content_types_return(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    ContentType = apps.get_model("contenttypes", "ContentType")
    for model, app in MOVED.items():
        ContentType.objects.filter(app_label=app, model=model).update(app_label="marketplace")


class Migration(migrations.Migration):
    dependencies = [
        ('contenttypes', '0002_remove_content_type_name'),
        ('accounts', '0001_initial'),
        ('billing', '0004_hold_key_in_accounts'),
        ('catalog', '0001_initial'),
        ('hosts', '0005_qualification_model_in_catalog'),
        ('marketplace', '0007_seed_embeddings'),
        ('mesh', '0005_models_in_catalog'),
    ]

    operations = [
        # The table stays where it is; only Django's idea of which app owns the model moves.
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name='request',
                    name='api_key',
                    field=models.ForeignKey(
                        on_delete=django.db.models.deletion.PROTECT, related_name='requests', to='accounts.apikey'
                    ),
                ),
                migrations.AlterField(
                    model_name='job',
                    name='model',
                    field=models.ForeignKey(
                        on_delete=django.db.models.deletion.PROTECT, related_name='jobs', to='catalog.catalogmodel'
                    ),
                ),
                migrations.AlterField(
                    model_name='request',
                    name='model',
                    field=models.ForeignKey(
                        on_delete=django.db.models.deletion.PROTECT, related_name='requests', to='catalog.catalogmodel'
                    ),
                ),
                migrations.DeleteModel(
                    name='ApiKey',
                ),
                migrations.DeleteModel(
                    name='CatalogModel',
                ),
            ],
        ),
        migrations.RunPython(content_types_follow, content_types_return),
    ]
