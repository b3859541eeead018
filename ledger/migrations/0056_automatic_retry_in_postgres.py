"""safe_to_retry without a person only where a retry is allowed, held by PostgreSQL: the
trigger `event_automatic_retry_check` refuses a move to safe_to_retry that no person made
when the operation's retry policy is `never`, or when the desk's unknown-outcome policy of
its kind (the matching row of its tenant that ranks first) says a person decides. The
reconciler already sent such verdicts to manual_review in Python; now no writer can do
otherwise (docs/reconcilers.md)."""

import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations

import ledger.models.triggers


class Migration(migrations.Migration):

    dependencies = [
        ('ledger', '0055_event_tenant_in_chain_columns'),
    ]

    operations = [
        pgtrigger.migrations.AddTrigger(
            model_name='operationevent',
            trigger=pgtrigger.compiler.Trigger(name='event_automatic_retry_check', sql=ledger.models.triggers.UnbypassableTriggerSql(condition="WHEN (NEW.to_state = 'safe_to_retry' AND NEW.actor_kind <> 'human')", declare='DECLARE op record; automatic boolean;', func="\n    SELECT o.operation, o.operation_id, o.tenant, o.retry_policy INTO op\n      FROM ledger_operation o WHERE o.id = NEW.operation_id;\n    IF op.retry_policy = 'never' THEN\n        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',\n            MESSAGE = format('operation %s: expected a person to decide a retry of an '\n                             'operation whose retry policy is never, found a move to '\n                             'safe_to_retry by %s %s', op.operation_id, NEW.actor_kind,\n                             NEW.actor_id);\n    END IF;\n    SELECT p.automatic_retry INTO automatic\n      FROM ledger_unknownoutcomepolicy p\n     WHERE p.tenant = op.tenant\n       AND op.operation LIKE replace(replace(replace(p.pattern, '_', '\\_'), '*', '%'), '?', '_')\n     ORDER BY p.pattern = op.operation DESC,\n              length(replace(replace(p.pattern, '*', ''), '?', '')) DESC, p.id\n     LIMIT 1;\n    IF automatic IS FALSE THEN\n        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',\n            MESSAGE = format('operation %s (%s): expected a person to decide a retry (the '\n                             'unknown-outcome policy of its kind on the desk says so), found '\n                             'a move to safe_to_retry by %s %s', op.operation_id,\n                             op.operation, NEW.actor_kind, NEW.actor_id);\n    END IF;\n    RETURN NEW;\n", hash='9c7e85d36840987540a842e18efa8eb2b467727d', operation='INSERT', pgid='pgtrigger_event_automatic_retry_check_5573a', table='ledger_operationevent', when='BEFORE')),
        ),
    ]
