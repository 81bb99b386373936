# A trusted host paid to score an audit (marketplace.trust.audits): a new ledger transaction kind.

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ('billing', '0009_alter_stripeevent_outcome'),
    ]

    operations = [
        migrations.AlterField(
            model_name='ledgertransaction',
            name='kind',
            field=models.CharField(
                choices=[
                    ('grant', 'Credit granted by an operator'),
                    ('topup', 'Top-up'),
                    ('settlement', 'Request settlement'),
                    ('payout_request', 'Host payout requested (earnings → pending)'),
                    ('payout_sent', 'Host payout sent (pending → outside)'),
                    ('payout_void', 'Host payout failed (pending → earnings)'),
                    ('forfeit', 'Unvested host earnings forfeited (earnings → platform), with the reason'),
                    ('refund', 'Top-up refunded by Stripe (customer credit → outside)'),
                    ('chargeback', 'Top-up disputed (customer credit → outside until the dispute is decided)'),
                    ('chargeback_won', 'Dispute won (the disputed credit comes back)'),
                    ('audit_release', 'An audit passed (held earnings → the host)'),
                    ('audit_refund', "An audit failed (held earnings and the platform's share → the customer)"),
                    ('audit_score', 'A trusted host scored an audit (platform → the scorer, its prefill\'s fee)'),
                ],
                max_length=16,
            ),
        ),
    ]
