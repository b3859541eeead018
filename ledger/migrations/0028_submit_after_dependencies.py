"""No effect before its dependencies, by PostgreSQL: an operation of a step is submitted only
once every step that step depends on is committed (ledger.models.operations,
_SUBMIT_AFTER_DEPENDENCIES). It was checked in Python alone (runs.require_dependencies_
committed, now gone: ledger.transitions raises DependencyNotMet from the refusal).
"""

import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations

import ledger.models.triggers


class Migration(migrations.Migration):

    dependencies = [
        ('ledger', '0027_event_reconciler_fenced'),
    ]

    operations = [
        pgtrigger.migrations.AddTrigger(
            model_name='operation',
            trigger=pgtrigger.compiler.Trigger(name='operation_submit_after_dependencies', sql=ledger.models.triggers.UnbypassableTriggerSql(condition="WHEN (NEW.state = 'submitted' AND OLD.state <> 'submitted' AND NEW.step_id IS NOT NULL)", declare='DECLARE missing text; missing_ids text;', func="\n    SELECT string_agg(dep.step_id || ' ' || dep.state, ', ' ORDER BY dep.step_id),\n           to_json(array_agg(dep.step_id ORDER BY dep.step_id))::text\n      INTO missing, missing_ids\n      FROM ledger_step_depends_on link\n      JOIN ledger_step dep ON dep.id = link.to_step_id\n     WHERE link.from_step_id = NEW.step_id AND dep.state <> 'committed';\n    IF missing IS NOT NULL THEN\n        RAISE EXCEPTION USING ERRCODE = 'check_violation',\n            MESSAGE = format('expected every step that %s depends on to be committed before '\n                             'operation %s (%s) is submitted, found %s',\n                             (SELECT step_id FROM ledger_step WHERE id = NEW.step_id),\n                             NEW.operation_id, NEW.operation, missing),\n            DETAIL = missing_ids,\n            HINT = 'dependency_not_met';\n    END IF;\n    RETURN NEW;\n", hash='1650f4f6e5c3dfbf9744c03ae2c71d915c7c4cfd', operation='UPDATE', pgid='pgtrigger_operation_submit_after_dependencies_6623d', table='ledger_operation', when='BEFORE')),
        ),
    ]
