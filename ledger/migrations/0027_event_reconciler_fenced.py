"""A reconciler's change is fenced by PostgreSQL: its event must carry the current token of
the lease reconcile:<operation_id>, or the insert is refused (ledger.models.operations,
_EVENT_RECONCILER_FENCED). Events written before are not touched: the trigger checks
inserts.
"""

import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations

import ledger.models.triggers


class Migration(migrations.Migration):

    dependencies = [
        ('ledger', '0026_event_fewer_indexes'),
    ]

    operations = [
        pgtrigger.migrations.AddTrigger(
            model_name='operationevent',
            trigger=pgtrigger.compiler.Trigger(name='event_reconciler_fenced', sql=ledger.models.triggers.UnbypassableTriggerSql(condition='WHEN (NEW."actor_kind" = \'reconciler\')', declare='DECLARE lease record;', func="\n    SELECT l.token, l.resource INTO lease\n      FROM ledger_operation o\n      JOIN ledger_lease l ON l.resource = 'reconcile:' || o.operation_id\n     WHERE o.id = NEW.operation_id\n       FOR SHARE OF l;\n    IF NOT FOUND OR NEW.fencing_token IS DISTINCT FROM lease.token THEN\n        RAISE EXCEPTION USING ERRCODE = 'check_violation',\n            MESSAGE = format('expected fencing token %s to be current for the reconciler''s '\n                             'lease of operation %s (%s -> %s), found %s',\n                             COALESCE(NEW.fencing_token::text, 'none'),\n                             (SELECT operation_id FROM ledger_operation\n                               WHERE id = NEW.operation_id),\n                             NEW.from_state, NEW.to_state,\n                             CASE WHEN lease.token IS NULL THEN 'no lease at all'\n                                  ELSE 'current token ' || lease.token END),\n            DETAIL = COALESCE(lease.token::text, ''),\n            HINT = 'stale_fencing_token';\n    END IF;\n    RETURN NEW;\n", hash='535fd8fd46d0c4eb4028ece6e33edb412990d58a', operation='INSERT', pgid='pgtrigger_event_reconciler_fenced_c7cc7', table='ledger_operationevent', when='BEFORE')),
        ),
    ]
