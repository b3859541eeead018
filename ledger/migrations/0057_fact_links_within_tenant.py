"""A candidate fact contradicts a fact of its own tenant, subject and predicate: the trigger
`fact_insert_check` reads the contradicted fact under the writer's row-level security and
refuses another tenant's (or one the writer may not see) with SQLSTATE 42501. Row-level
security cannot hold a fact's links to other facts, since a policy cannot read its own
table."""

import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations

import ledger.models.triggers


class Migration(migrations.Migration):

    dependencies = [
        ('ledger', '0056_automatic_retry_in_postgres'),
    ]

    operations = [
        pgtrigger.migrations.RemoveTrigger(
            model_name='fact',
            name='fact_insert_check',
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='fact',
            trigger=pgtrigger.compiler.Trigger(name='fact_insert_check', sql=ledger.models.triggers.UnbypassableTriggerSql(declare='DECLARE prev record;', func="\n    IF NEW.superseded_by_id IS NOT NULL OR NEW.status NOT IN ('current', 'candidate') THEN\n        RAISE EXCEPTION USING ERRCODE = 'check_violation',\n            MESSAGE = format('fact %s %s: expected a new fact to be current or a candidate '\n                             'and superseded by nothing, found status %s', NEW.subject,\n                             NEW.predicate, NEW.status);\n    END IF;\n    SELECT id, tenant, subject, predicate, version INTO prev\n      FROM ledger_fact WHERE superseded_by_id = NEW.id;\n    IF FOUND THEN\n        IF NEW.status <> 'current' OR prev.tenant <> NEW.tenant OR prev.subject <> NEW.subject\n           OR prev.predicate <> NEW.predicate OR NEW.version IS DISTINCT FROM prev.version + 1\n        THEN\n            RAISE EXCEPTION USING ERRCODE = 'check_violation',\n                MESSAGE = format('fact %s %s: expected the successor of version %s to be the '\n                                 'current version %s of the same subject and predicate, found '\n                                 '%s %s %s version %s', prev.subject, prev.predicate,\n                                 prev.version, prev.version + 1, NEW.status, NEW.subject,\n                                 NEW.predicate, NEW.version);\n        END IF;\n    ELSIF NEW.status = 'current' AND NEW.version IS DISTINCT FROM 1 THEN\n        RAISE EXCEPTION USING ERRCODE = 'check_violation',\n            MESSAGE = format('fact %s %s: expected version 1 for a first value, or a link from '\n                             'the version it supersedes, found version %s and no link',\n                             NEW.subject, NEW.predicate, NEW.version);\n    END IF;\n    IF NEW.contradicts_id IS NOT NULL THEN\n        -- A candidate contradicts a version of its own tenant, subject and predicate (read\n        -- under the writer's row-level security: another tenant's fact is not found).\n        SELECT id, tenant, subject, predicate, version INTO prev\n          FROM ledger_fact WHERE id = NEW.contradicts_id;\n        IF NOT FOUND OR prev.tenant <> NEW.tenant THEN\n            RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',\n                MESSAGE = format('fact %s %s: expected the candidate to contradict a fact of '\n                                 'its tenant %s, found fact id %s %s', NEW.subject,\n                                 NEW.predicate, NEW.tenant, NEW.contradicts_id,\n                                 CASE WHEN FOUND THEN 'of another tenant'\n                                      ELSE 'not there or not visible' END);\n        END IF;\n        IF prev.subject <> NEW.subject OR prev.predicate <> NEW.predicate THEN\n            RAISE EXCEPTION USING ERRCODE = 'check_violation',\n                MESSAGE = format('fact %s %s: expected the candidate to contradict a version '\n                                 'of the same subject and predicate, found %s %s', NEW.subject,\n                                 NEW.predicate, prev.subject, prev.predicate);\n        END IF;\n    END IF;\n    RETURN NEW;\n", hash='b0f1fbd8cc5f543d0a6ccbd463b690ed00a51544', operation='INSERT', pgid='pgtrigger_fact_insert_check_ce7d2', table='ledger_fact', when='BEFORE')),
        ),
    ]
