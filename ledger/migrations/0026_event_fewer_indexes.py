"""Two indexes fewer on operation events, the table every transition writes to.

The foreign key to the operation had an index of its own that event_one_per_operation_
version (operation, version) already serves; decided_by's covered every event, though only
a person's decisions have one. Only the indexes change: the constraints stay as they are
(Django's AlterField would drop and re-add both foreign keys, scanning the table under an
exclusive lock to validate them again).
"""

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('ledger', '0025_sealer'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(
                    'DROP INDEX IF EXISTS "ledger_operationevent_operation_id_a2e1e3a0"',
                    'CREATE INDEX "ledger_operationevent_operation_id_a2e1e3a0"'
                    ' ON "ledger_operationevent" ("operation_id")',
                ),
                migrations.RunSQL(
                    'DROP INDEX IF EXISTS "ledger_operationevent_decided_by_id_dbe42fb4"',
                    'CREATE INDEX "ledger_operationevent_decided_by_id_dbe42fb4"'
                    ' ON "ledger_operationevent" ("decided_by_id")',
                ),
            ],
            state_operations=[
                migrations.AlterField(
                    model_name='operationevent',
                    name='decided_by',
                    field=models.ForeignKey(blank=True, db_index=False, null=True, on_delete=django.db.models.deletion.PROTECT, related_name='+', to=settings.AUTH_USER_MODEL),
                ),
                migrations.AlterField(
                    model_name='operationevent',
                    name='operation',
                    field=models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='events', to='ledger.operation'),
                ),
            ],
        ),
        migrations.AddIndex(
            model_name='operationevent',
            index=models.Index(condition=models.Q(('decided_by__isnull', False)), fields=['decided_by'], name='event_decided_by_idx'),
        ),
    ]
