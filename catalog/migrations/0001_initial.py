"""CatalogModel moves here from marketplace, keeping its table (marketplace_catalogmodel)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    dependencies = [
        ('marketplace', '0007_seed_embeddings'),
    ]

    operations = [
        # The table stays where it is; only Django's idea of which app owns the model moves.
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name='CatalogModel',
                    fields=[
                        (
                            'id',
                            models.BigAutoField(
                                auto_created=True, primary_key=True, serialize=False, verbose_name='ID'
                            ),
                        ),
                        ('name', models.CharField(max_length=100, unique=True)),
                        (
                            'kind',
                            models.CharField(
                                choices=[('chat', 'Chat'), ('embedding', 'Embedding')], default='chat', max_length=16
                            ),
                        ),
                        ('context_length', models.PositiveIntegerField()),
                        ('input_price_ucents', models.BigIntegerField(help_text='µ¢ per prompt token')),
                        ('output_price_ucents', models.BigIntegerField(help_text='µ¢ per generated token')),
                        (
                            'tokenizer',
                            models.CharField(
                                help_text='how the gateway counts tokens, e.g. shipped:gemma-3-270m', max_length=100
                            ),
                        ),
                        ('active', models.BooleanField(default=True)),
                        (
                            'routing_strategy',
                            models.CharField(
                                blank=True,
                                choices=[('least-connections', 'least-connections'), ('weighted', 'weighted')],
                                help_text="how jobs are spread over warm hosts; empty = the gateway's ROUTING_STRATEGY",
                                max_length=24,
                            ),
                        ),
                        (
                            'latency_critical',
                            models.BooleanField(
                                default=False,
                                help_text=(
                                    'keep on at least two warm hosts (the admin and host dashboards warn otherwise)'
                                ),
                            ),
                        ),
                        ('created_at', models.DateTimeField(auto_now_add=True)),
                    ],
                    options={
                        'db_table': 'marketplace_catalogmodel',
                        'constraints': [
                            models.CheckConstraint(
                                condition=models.Q(('input_price_ucents__gte', 0), ('output_price_ucents__gte', 0)),
                                name='prices_not_negative',
                            )
                        ],
                    },
                ),
            ],
        ),
    ]
