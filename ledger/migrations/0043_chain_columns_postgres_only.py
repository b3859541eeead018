"""The chain's columns are PostgreSQL's alone (ledger.chain_content): every operation event
is written unsealed (a writer's chain_seq or chain_hash is refused; only the sealer's
`ledger_seal_events` links it), in the current chain format (4), with the content PostgreSQL
computes from its operation's row, whatever the writer sent. And the signed checkpoints of
the chains' heads (AuditCheckpoint, ledger.audit_bundle), append-only."""

import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations, models

import ledger.models.triggers


class Migration(migrations.Migration):

    dependencies = [
        ('ledger', '0042_lease_functions_approval_guard_worker_locks'),
    ]

    operations = [
        migrations.CreateModel(
            name='AuditCheckpoint',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('chain', models.CharField(max_length=40)),
                ('tenant', models.CharField(max_length=100)),
                ('seq', models.BigIntegerField()),
                ('hash', models.CharField(max_length=64)),
                ('signed_at', models.DateTimeField()),
                ('key_id', models.CharField(max_length=16)),
                ('signature', models.CharField(max_length=128)),
            ],
            options={
                'ordering': ['chain', 'tenant', 'seq', 'id'],
            },
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='operationevent',
            trigger=pgtrigger.compiler.Trigger(name='event_chain_columns', sql=ledger.models.triggers.UnbypassableTriggerSql(func='\n    IF NEW.chain_seq IS NOT NULL OR NEW.chain_hash IS NOT NULL THEN\n        RAISE EXCEPTION USING ERRCODE = \'insufficient_privilege\',\n            MESSAGE = format(\'event of operation %s at version %s: expected it written \'\n                             \'unsealed (chain_seq and chain_hash NULL: only the sealer links \'\n                             \'an event, through ledger_seal_events), found chain_seq %s\',\n                             NEW.operation_id, NEW.version,\n                             COALESCE(NEW.chain_seq::text, \'NULL\'));\n    END IF;\n    NEW.chain_format := 4;\n    SELECT jsonb_build_object(\'target\', o.target, \'intent\', encode(sha256(convert_to((o.intent)::text, \'UTF8\')), \'hex\'), \'fingerprint\', o.intent_fingerprint, \'key\', o.idempotency_key, \'retry_policy\', o.retry_policy, \'result\', encode(sha256(convert_to((o.result)::text, \'UTF8\')), \'hex\'), \'operation\', o.operation, \'tenant\', o.tenant, \'run\', o.run_id, \'step\', o.step_id, \'relies_on\', encode(sha256(convert_to((o.relies_on)::text, \'UTF8\')), \'hex\'), \'attempt\', o.attempt, \'created_at\', to_char((o.created_at) AT TIME ZONE \'UTC\', \'YYYY-MM-DD"T"HH24:MI:SS.US"Z"\'), \'submitted_at\', to_char((o.submitted_at) AT TIME ZONE \'UTC\', \'YYYY-MM-DD"T"HH24:MI:SS.US"Z"\'), \'in_flight_until\', to_char((o.in_flight_until) AT TIME ZONE \'UTC\', \'YYYY-MM-DD"T"HH24:MI:SS.US"Z"\'), \'completed_at\', to_char((o.completed_at) AT TIME ZONE \'UTC\', \'YYYY-MM-DD"T"HH24:MI:SS.US"Z"\'), \'error_code\', o.error_code, \'error_detail\', encode(sha256(convert_to((o.error_detail)::text, \'UTF8\')), \'hex\'), \'conflict\', o.conflict, \'trace_id\', o.trace_id, \'span_id\', o.span_id, \'authentication_recorded\', o.authentication_recorded, \'unknown_since\', to_char((o.unknown_since) AT TIME ZONE \'UTC\', \'YYYY-MM-DD"T"HH24:MI:SS.US"Z"\'), \'next_attempt_at\', to_char((o.next_attempt_at) AT TIME ZONE \'UTC\', \'YYYY-MM-DD"T"HH24:MI:SS.US"Z"\'), \'reconcile_attempts\', o.reconcile_attempts, \'reconcile_failures\', o.reconcile_failures, \'reread_due_at\', to_char((o.reread_due_at) AT TIME ZONE \'UTC\', \'YYYY-MM-DD"T"HH24:MI:SS.US"Z"\'), \'result_unstorable\', o.result_unstorable) INTO NEW.content\n      FROM ledger_operation o WHERE o.id = NEW.operation_id;\n    RETURN NEW;\n', hash='6e80048b7bfd42045710f0fca94121ad365e74de', operation='INSERT', pgid='pgtrigger_event_chain_columns_1d0f6', table='ledger_operationevent', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='auditcheckpoint',
            trigger=pgtrigger.compiler.Trigger(name='audit_checkpoint_append_only', sql=ledger.models.triggers.UnbypassableTriggerSql(func="RAISE EXCEPTION 'pgtrigger: Cannot update or delete rows from % table', TG_TABLE_NAME;", hash='df2685532e8d317039c35c39a5daf34ccc531b48', operation='UPDATE OR DELETE', pgid='pgtrigger_audit_checkpoint_append_only_8a5ed', table='ledger_auditcheckpoint', when='BEFORE')),
        ),
    ]
