"""ApiKey moves here from marketplace, keeping its table (marketplace_apikey)."""

import django.db.models.deletion
import django.db.models.expressions
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    dependencies = [
        ('marketplace', '0007_seed_embeddings'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        # The table stays where it is; only Django's idea of which app owns the model moves.
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name='ApiKey',
                    fields=[
                        (
                            'id',
                            models.BigAutoField(
                                auto_created=True, primary_key=True, serialize=False, verbose_name='ID'
                            ),
                        ),
                        ('name', models.CharField(blank=True, max_length=100)),
                        ('prefix', models.CharField(max_length=16)),
                        ('key_hash', models.CharField(max_length=64, unique=True)),
                        ('spend_cap_ucents', models.BigIntegerField(blank=True, null=True)),
                        (
                            'rate_limit_per_minute',
                            models.PositiveIntegerField(
                                blank=True, help_text='admissions per rolling minute; empty = unlimited', null=True
                            ),
                        ),
                        (
                            'max_concurrent',
                            models.PositiveIntegerField(
                                blank=True, help_text='requests in flight at once; empty = unlimited', null=True
                            ),
                        ),
                        ('spent_ucents', models.BigIntegerField(default=0)),
                        ('held_ucents', models.BigIntegerField(default=0)),
                        ('revoked_at', models.DateTimeField(blank=True, null=True)),
                        ('last_used_at', models.DateTimeField(blank=True, null=True)),
                        ('created_at', models.DateTimeField(auto_now_add=True)),
                        (
                            'user',
                            models.ForeignKey(
                                on_delete=django.db.models.deletion.PROTECT,
                                related_name='api_keys',
                                to=settings.AUTH_USER_MODEL,
                            ),
                        ),
                    ],
                    options={
                        'db_table': 'marketplace_apikey',
                        'constraints': [
                            models.CheckConstraint(
                                condition=models.Q(('held_ucents__gte', 0), ('spent_ucents__gte', 0)),
                                name='key_sums_not_negative',
                            ),
                            models.CheckConstraint(
                                condition=models.Q(
                                    ('spend_cap_ucents__isnull', True),
                                    (
                                        'spend_cap_ucents__gte',
                                        django.db.models.expressions.CombinedExpression(
                                            models.F('spent_ucents'), '+', models.F('held_ucents')
                                        ),
                                    ),
                                    _connector='OR',
                                ),
                                name='key_within_cap',
                            ),
                        ],
                    },
                ),
            ],
        ),
    ]
