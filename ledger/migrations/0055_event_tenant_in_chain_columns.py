"""An event's tenant is held to its operation's by `event_chain_columns`, which already reads
the operation's row for the event's content: the deferred constraint trigger
`event_tenant_check` (0048) read the same row again at every commit, and is dropped.

The check is now immediate (at the event's INSERT, not at commit) and says the same thing:
an operation of another tenant, or one this session's row-level security hides, refuses
the event.
"""

import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations

import ledger.models.triggers


class Migration(migrations.Migration):

    dependencies = [
        ('ledger', '0054_unknown_outcome_policies'),
    ]

    operations = [
        migrations.RunSQL(
            sql="""
DROP TRIGGER IF EXISTS event_tenant_check ON ledger_operationevent;
DROP FUNCTION IF EXISTS ledger_event_tenant_check();
""",
            reverse_sql=r"""
CREATE FUNCTION ledger_event_tenant_check() RETURNS trigger
LANGUAGE plpgsql SET search_path = public, pg_temp AS $$
DECLARE
    op_tenant text;
BEGIN
    SELECT o.tenant INTO op_tenant FROM ledger_operation o WHERE o.id = NEW.operation_id;
    IF op_tenant IS DISTINCT FROM NEW.tenant THEN
        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',
            MESSAGE = format('event of operation id %s: expected its operation''s tenant, '
                             'found %s on the event and %s on an operation this session '
                             'may see', NEW.operation_id, NEW.tenant,
                             COALESCE(op_tenant, 'none'));
    END IF;
    RETURN NULL;
END
$$;
CREATE CONSTRAINT TRIGGER event_tenant_check AFTER INSERT ON ledger_operationevent
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION ledger_event_tenant_check();
ALTER TABLE ledger_operationevent ENABLE ALWAYS TRIGGER event_tenant_check;
""",
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name='operationevent',
            name='event_chain_columns',
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='operationevent',
            trigger=pgtrigger.compiler.Trigger(name='event_chain_columns', sql=ledger.models.triggers.UnbypassableTriggerSql(declare='DECLARE op_tenant text;', func='\n    IF NEW.chain_seq IS NOT NULL OR NEW.chain_hash IS NOT NULL THEN\n        RAISE EXCEPTION USING ERRCODE = \'insufficient_privilege\',\n            MESSAGE = format(\'event of operation %s at version %s: expected it written \'\n                             \'unsealed (chain_seq and chain_hash NULL: only the sealer links \'\n                             \'an event, through ledger_seal_events), found chain_seq %s\',\n                             NEW.operation_id, NEW.version,\n                             COALESCE(NEW.chain_seq::text, \'NULL\'));\n    END IF;\n    NEW.chain_format := 5;\n    SELECT jsonb_build_object(\'target\', o.target, \'intent\', encode(sha256(convert_to((o.intent)::text, \'UTF8\')), \'hex\'), \'fingerprint\', o.intent_fingerprint, \'key\', o.idempotency_key, \'retry_policy\', o.retry_policy, \'result\', encode(sha256(convert_to((o.result)::text, \'UTF8\')), \'hex\'), \'operation\', o.operation, \'tenant\', o.tenant, \'run\', o.run_id, \'step\', o.step_id, \'relies_on\', encode(sha256(convert_to((o.relies_on)::text, \'UTF8\')), \'hex\'), \'attempt\', o.attempt, \'created_at\', to_char((o.created_at) AT TIME ZONE \'UTC\', \'YYYY-MM-DD"T"HH24:MI:SS.US"Z"\'), \'submitted_at\', to_char((o.submitted_at) AT TIME ZONE \'UTC\', \'YYYY-MM-DD"T"HH24:MI:SS.US"Z"\'), \'in_flight_until\', to_char((o.in_flight_until) AT TIME ZONE \'UTC\', \'YYYY-MM-DD"T"HH24:MI:SS.US"Z"\'), \'completed_at\', to_char((o.completed_at) AT TIME ZONE \'UTC\', \'YYYY-MM-DD"T"HH24:MI:SS.US"Z"\'), \'error_code\', o.error_code, \'error_detail\', encode(sha256(convert_to((o.error_detail)::text, \'UTF8\')), \'hex\'), \'conflict\', o.conflict, \'trace_id\', o.trace_id, \'span_id\', o.span_id, \'authentication_recorded\', o.authentication_recorded, \'unknown_since\', to_char((o.unknown_since) AT TIME ZONE \'UTC\', \'YYYY-MM-DD"T"HH24:MI:SS.US"Z"\'), \'next_attempt_at\', to_char((o.next_attempt_at) AT TIME ZONE \'UTC\', \'YYYY-MM-DD"T"HH24:MI:SS.US"Z"\'), \'reconcile_attempts\', o.reconcile_attempts, \'reconcile_failures\', o.reconcile_failures, \'reread_due_at\', to_char((o.reread_due_at) AT TIME ZONE \'UTC\', \'YYYY-MM-DD"T"HH24:MI:SS.US"Z"\'), \'result_unstorable\', o.result_unstorable, \'account\', o.account), o.tenant INTO NEW.content, op_tenant\n      FROM ledger_operation o WHERE o.id = NEW.operation_id;\n    IF op_tenant IS DISTINCT FROM NEW.tenant THEN\n        RAISE EXCEPTION USING ERRCODE = \'insufficient_privilege\',\n            MESSAGE = format(\'event of operation id %s: expected its operation\'\'s tenant, \'\n                             \'found %s on the event and %s on an operation this session \'\n                             \'may see\', NEW.operation_id, NEW.tenant,\n                             COALESCE(op_tenant, \'none\'));\n    END IF;\n    RETURN NEW;\n', hash='c7e4534c4658bfa17bcb3bb4ee4df4f055b7fd1f', operation='INSERT', pgid='pgtrigger_event_chain_columns_1d0f6', table='ledger_operationevent', when='BEFORE')),
        ),
    ]
