"""Chain format 3: an operation event carries its operation's identity and content as of
the event (`content`: target, intent and result digests, fingerprint, key, retry policy),
which its link covers (ledger.chain). Events written before keep NULL and their format."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('ledger', '0036_operation_columns_with_their_event'),
    ]

    operations = [
        migrations.AddField(
            model_name='operationevent',
            name='content',
            field=models.JSONField(blank=True, null=True),
        ),
    ]
