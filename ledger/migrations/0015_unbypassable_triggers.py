"""The ledger's rules can no longer be switched off by a session setting.

Every trigger is reinstalled without pgtrigger's `pgtrigger.ignore` hook (any role may set
that setting; see ledger.models.triggers), with its search_path pinned, and a settled
(terminal) receipt is frozen but for its conflict flag (`operation_unchanged_when_terminal`).

Retention, the one sanctioned writer of append-only rows and settled receipts, now runs in
two SECURITY DEFINER functions owned by the migrating role (the tables' owner), which the
application role may EXECUTE (ledger/sql/app_role.sql) but not imitate:

- `ledger_retention_purge(run, ids)` deletes the given operations with their events and
  evidence, anchors the chain where a gap starts and adds the counts to the PurgeRun;
- `ledger_retention_redact(run, ids)` replaces their intent, error detail and evidence
  payloads and records one Redaction row each, counted on the PurgeRun.

Each refuses (raising, nothing written) an operation that is not terminal or not older than
the horizon of the run's policy at the database's clock, a dry or finished run, a run
without a policy. The triggers that let them through ask `ledger_sanctioned(relid)`: the
current user owns the table and the transaction-local `ledger.sanctioned` is 'retention',
which only the two functions set, for their own duration.
"""

import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations

import ledger.models.triggers

# ledger.states.TERMINAL as it is at this migration, frozen.
_TERMINAL = "'abandoned', 'rejected', 'succeeded'"
_REDACTED = '{"retention": "[redacted]"}'  # ledger.retention.REDACTED_PAYLOAD, frozen here

_RUN_CHECK = """
    SELECT * INTO run FROM ledger_purgerun WHERE id = run_id FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('expected the PurgeRun recording this %s, found no run %s',
                             doing, run_id);
    END IF;
    IF run.dry_run OR run.finished_at IS NOT NULL OR run.policy_id IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('expected an unfinished PurgeRun, not a dry run, with a policy, to '
                             'record this %s, found run %s (dry run %s, finished at %s, '
                             'policy %s)', doing, run_id, run.dry_run, run.finished_at,
                             run.policy_id);
    END IF;
"""

_NOT_ELIGIBLE = """
    IF FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('operation %s: expected a terminal ({terminal}) operation completed '
                             'more than %s days ago to %s, found state %s completed at %s',
                             bad.operation_id, horizon_days, doing, bad.state, bad.completed_at);
    END IF;
""".replace("{terminal}", _TERMINAL.replace("'", ""))

FUNCTIONS = f"""
CREATE OR REPLACE FUNCTION ledger_sanctioned(relid oid) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT coalesce(pg_catalog.current_setting('ledger.sanctioned', true), '') = 'retention'
       AND EXISTS (SELECT 1 FROM pg_catalog.pg_class c
                    WHERE c.oid = relid
                      AND c.relowner = (SELECT r.oid FROM pg_catalog.pg_roles r
                                         WHERE r.rolname = current_user))
$$;

CREATE OR REPLACE FUNCTION ledger_retention_purge(run_id bigint, operation_ids bigint[])
RETURNS SETOF varchar
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = public, pg_temp
SET ledger.sanctioned = 'retention'
AS $$
DECLARE
    doing text := 'purge';
    run ledger_purgerun;
    horizon_days integer;
    bad record;
    pks bigint[];
    ids varchar[];
    evidence_count integer;
    event_count integer;
BEGIN
    {_RUN_CHECK}
    SELECT greatest(p.purge_after_days, p.keep_events_days) INTO horizon_days
      FROM ledger_retentionpolicy p WHERE p.id = run.policy_id;
    SELECT o.operation_id, o.state, o.completed_at INTO bad FROM ledger_operation o
     WHERE o.id = ANY(operation_ids)
       AND NOT (o.state IN ({_TERMINAL}) AND o.completed_at IS NOT NULL
                AND o.completed_at < now() - make_interval(days => horizon_days))
     LIMIT 1;
    {_NOT_ELIGIBLE}
    WITH gone AS (
        DELETE FROM ledger_operation o WHERE o.id = ANY(operation_ids)
        RETURNING o.id, o.operation_id)
    SELECT array_agg(id), array_agg(operation_id ORDER BY operation_id COLLATE "C")
      INTO pks, ids FROM gone;
    IF pks IS NULL THEN
        RETURN;
    END IF;
    DELETE FROM ledger_evidence WHERE operation_id = ANY(pks);
    GET DIAGNOSTICS evidence_count = ROW_COUNT;
    WITH links AS (
        DELETE FROM ledger_operationevent WHERE operation_id = ANY(pks)
        RETURNING tenant, chain_seq, chain_hash),
    anchored AS (
        -- The last deleted link of each gap, so the rest of the chain verifies.
        INSERT INTO ledger_chainanchor (chain, tenant, seq, hash, purge_run_id, created_at)
        SELECT 'operation_events', l.tenant, l.chain_seq, l.chain_hash, run.id, now()
          FROM links l
         WHERE NOT EXISTS (SELECT 1 FROM links n
                            WHERE n.tenant = l.tenant AND n.chain_seq = l.chain_seq + 1)
        ON CONFLICT DO NOTHING)
    SELECT count(*) INTO event_count FROM links;
    UPDATE ledger_purgerun
       SET operations_purged = operations_purged + cardinality(ids),
           events_purged = events_purged + event_count,
           evidence_purged = evidence_purged + evidence_count,
           first_operation_id = CASE WHEN first_operation_id = '' THEN ids[1]
                                     ELSE least(first_operation_id COLLATE "C", ids[1]) END,
           last_operation_id = greatest(last_operation_id COLLATE "C", ids[cardinality(ids)])
     WHERE id = run.id;
    RETURN QUERY SELECT unnest(ids);
END;
$$;

CREATE OR REPLACE FUNCTION ledger_retention_redact(run_id bigint, operation_ids bigint[])
RETURNS SETOF varchar
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = public, pg_temp
SET ledger.sanctioned = 'retention'
AS $$
DECLARE
    doing text := 'redaction';
    run ledger_purgerun;
    horizon_days integer;
    bad record;
    ids varchar[];
    evidence_count integer;
BEGIN
    {_RUN_CHECK}
    SELECT p.redact_after_days INTO horizon_days
      FROM ledger_retentionpolicy p WHERE p.id = run.policy_id;
    IF horizon_days IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('expected run %s''s policy to redact after some days, found a '
                             'policy that never redacts', run_id);
    END IF;
    SELECT o.operation_id, o.state, o.completed_at INTO bad FROM ledger_operation o
     WHERE o.id = ANY(operation_ids)
       AND NOT (o.state IN ({_TERMINAL}) AND o.completed_at IS NOT NULL
                AND o.completed_at < now() - make_interval(days => horizon_days)
                AND o.redacted_at IS NULL)
     LIMIT 1;
    {_NOT_ELIGIBLE}
    WITH changed AS (
        UPDATE ledger_operation o
           SET intent = '{_REDACTED}'::jsonb, error_detail = '', redacted_at = now()
         WHERE o.id = ANY(operation_ids)
        RETURNING o.id, o.operation_id, o.tenant, o.intent_fingerprint),
    evidence AS (
        UPDATE ledger_evidence e
           SET query = '{_REDACTED}'::jsonb, observed = '{_REDACTED}'::jsonb, detail = '',
               redacted_at = now()
          FROM changed WHERE e.operation_id = changed.id
        RETURNING e.operation_id),
    recorded AS (
        INSERT INTO ledger_redaction
               (operation_ref, tenant, intent_fingerprint, evidence_rows, purge_run_id,
                redacted_at)
        SELECT c.operation_id, c.tenant, c.intent_fingerprint,
               (SELECT count(*) FROM evidence WHERE evidence.operation_id = c.id), run.id, now()
          FROM changed c
        RETURNING operation_ref, evidence_rows)
    SELECT array_agg(operation_ref ORDER BY operation_ref COLLATE "C"),
           coalesce(sum(evidence_rows), 0)
      INTO ids, evidence_count FROM recorded;
    IF ids IS NULL THEN
        RETURN;
    END IF;
    UPDATE ledger_purgerun
       SET operations_redacted = operations_redacted + cardinality(ids),
           evidence_redacted = evidence_redacted + evidence_count
     WHERE id = run.id;
    RETURN QUERY SELECT unnest(ids);
END;
$$;

REVOKE ALL ON FUNCTION ledger_retention_purge(bigint, bigint[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION ledger_retention_redact(bigint, bigint[]) FROM PUBLIC;
"""

DROP_FUNCTIONS = """
DROP FUNCTION IF EXISTS ledger_retention_redact(bigint, bigint[]);
DROP FUNCTION IF EXISTS ledger_retention_purge(bigint, bigint[]);
DROP FUNCTION IF EXISTS ledger_sanctioned(oid);
"""


class Migration(migrations.Migration):

    dependencies = [
        ('ledger', '0014_fenced_and_decided_events'),
    ]

    operations = [
        migrations.RunSQL(FUNCTIONS, DROP_FUNCTIONS),
        pgtrigger.migrations.RemoveTrigger(
            model_name='agentkeychange',
            name='agent_key_change_append_only',
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name='chainanchor',
            name='chain_anchor_append_only',
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name='episode',
            name='episode_append_only',
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name='evidence',
            name='evidence_append_only',
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name='fact',
            name='fact_never_updated_in_place',
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name='fact',
            name='fact_insert_check',
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name='factconflict',
            name='conflict_settled_once',
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name='factdecision',
            name='fact_decision_append_only',
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name='obligation',
            name='obligation_settled_once',
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name='operation',
            name='operation_transition_check',
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name='operation',
            name='operation_insert_planned',
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name='operation',
            name='operation_insert_evented',
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name='operation',
            name='operation_change_evented',
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name='operation',
            name='operation_delete_terminal_only',
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name='operationevent',
            name='event_append_only',
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name='redaction',
            name='redaction_append_only',
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name='retentionchange',
            name='retention_change_append_only',
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name='step',
            name='step_lifecycle_check',
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name='tenantaccesschange',
            name='tenant_access_change_append_only',
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='agentkeychange',
            trigger=pgtrigger.compiler.Trigger(name='agent_key_change_append_only', sql=ledger.models.triggers.UnbypassableTriggerSql(func="RAISE EXCEPTION 'pgtrigger: Cannot update or delete rows from % table', TG_TABLE_NAME;", hash='b518cb6c47e6551b7d0d8e77e3f7107a40a52194', operation='UPDATE OR DELETE', pgid='pgtrigger_agent_key_change_append_only_19fbc', table='ledger_agentkeychange', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='chainanchor',
            trigger=pgtrigger.compiler.Trigger(name='chain_anchor_append_only', sql=ledger.models.triggers.UnbypassableTriggerSql(func="RAISE EXCEPTION 'pgtrigger: Cannot update or delete rows from % table', TG_TABLE_NAME;", hash='eee0e54aedeea2f7b437be118add21a43fbfe2da', operation='UPDATE OR DELETE', pgid='pgtrigger_chain_anchor_append_only_487fa', table='ledger_chainanchor', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='episode',
            trigger=pgtrigger.compiler.Trigger(name='episode_append_only', sql=ledger.models.triggers.UnbypassableTriggerSql(func="RAISE EXCEPTION 'pgtrigger: Cannot update or delete rows from % table', TG_TABLE_NAME;", hash='a00c47ae273b558fb08eec3fa5d22ba3ebb15a19', operation='UPDATE OR DELETE', pgid='pgtrigger_episode_append_only_40960', table='ledger_episode', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='evidence',
            trigger=pgtrigger.compiler.Trigger(name='evidence_append_only', sql=ledger.models.triggers.UnbypassableTriggerSql(func="\n        IF ledger_sanctioned(TG_RELID) THEN\n            RETURN NULL;\n        END IF;\n        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',\n            MESSAGE = format('pgtrigger: Cannot update or delete rows from %s table: expected '\n                             'only INSERT (it is append-only; retention removes and redacts '\n                             'rows through ledger_retention_purge and ledger_retention_redact), '\n                             'found %s', TG_TABLE_NAME, TG_OP);\n        ", hash='2acc719a0107858dfbfb92acf92c970b907c9616', level='STATEMENT', operation='UPDATE OR DELETE', pgid='pgtrigger_evidence_append_only_a4b08', table='ledger_evidence', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='fact',
            trigger=pgtrigger.compiler.Trigger(name='fact_never_updated_in_place', sql=ledger.models.triggers.UnbypassableTriggerSql(func="\n    IF TG_OP = 'DELETE' THEN\n        RAISE EXCEPTION USING ERRCODE = 'check_violation',\n            MESSAGE = format('fact %s (%s %s, version %s): expected facts never to be deleted, '\n                             'found a DELETE', OLD.id, OLD.subject, OLD.predicate, OLD.version);\n    END IF;\n    IF OLD.status = 'current' AND NEW.status = 'superseded'\n       AND OLD.superseded_by_id IS NULL AND NEW.superseded_by_id IS NOT NULL\n       AND NOT EXISTS (SELECT 1 FROM ledger_fact WHERE id = NEW.superseded_by_id)\n       AND (to_jsonb(NEW) - 'status' - 'superseded_by_id')\n           = (to_jsonb(OLD) - 'status' - 'superseded_by_id') THEN\n        RETURN NEW;\n    END IF;\n    RAISE EXCEPTION USING ERRCODE = 'check_violation',\n        MESSAGE = format('fact %s (%s %s, version %s): expected no change but linking a '\n                         'current version once to the new version that supersedes it, found '\n                         'an UPDATE (status %s -> %s, superseded_by %s -> %s); write a new '\n                         'version with ledger.facts.assert_fact', OLD.id, OLD.subject,\n                         OLD.predicate, OLD.version, OLD.status, NEW.status,\n                         OLD.superseded_by_id, NEW.superseded_by_id);\n", hash='8c2c34160bded03937f7b91b74872055a9072cab', operation='UPDATE OR DELETE', pgid='pgtrigger_fact_never_updated_in_place_53925', table='ledger_fact', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='fact',
            trigger=pgtrigger.compiler.Trigger(name='fact_insert_check', sql=ledger.models.triggers.UnbypassableTriggerSql(declare='DECLARE prev record;', func="\n    IF NEW.superseded_by_id IS NOT NULL OR NEW.status NOT IN ('current', 'candidate') THEN\n        RAISE EXCEPTION USING ERRCODE = 'check_violation',\n            MESSAGE = format('fact %s %s: expected a new fact to be current or a candidate '\n                             'and superseded by nothing, found status %s', NEW.subject,\n                             NEW.predicate, NEW.status);\n    END IF;\n    SELECT id, tenant, subject, predicate, version INTO prev\n      FROM ledger_fact WHERE superseded_by_id = NEW.id;\n    IF FOUND THEN\n        IF NEW.status <> 'current' OR prev.tenant <> NEW.tenant OR prev.subject <> NEW.subject\n           OR prev.predicate <> NEW.predicate OR NEW.version IS DISTINCT FROM prev.version + 1\n        THEN\n            RAISE EXCEPTION USING ERRCODE = 'check_violation',\n                MESSAGE = format('fact %s %s: expected the successor of version %s to be the '\n                                 'current version %s of the same subject and predicate, found '\n                                 '%s %s %s version %s', prev.subject, prev.predicate,\n                                 prev.version, prev.version + 1, NEW.status, NEW.subject,\n                                 NEW.predicate, NEW.version);\n        END IF;\n    ELSIF NEW.status = 'current' AND NEW.version IS DISTINCT FROM 1 THEN\n        RAISE EXCEPTION USING ERRCODE = 'check_violation',\n            MESSAGE = format('fact %s %s: expected version 1 for a first value, or a link from '\n                             'the version it supersedes, found version %s and no link',\n                             NEW.subject, NEW.predicate, NEW.version);\n    END IF;\n    RETURN NEW;\n", hash='0f44b4480b28bce674fea0f3e157e8dc658d00d7', operation='INSERT', pgid='pgtrigger_fact_insert_check_ce7d2', table='ledger_fact', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='factconflict',
            trigger=pgtrigger.compiler.Trigger(name='conflict_settled_once', sql=ledger.models.triggers.UnbypassableTriggerSql(func="\n    IF TG_OP = 'DELETE' THEN\n        RAISE EXCEPTION USING ERRCODE = 'check_violation',\n            MESSAGE = format('fact conflict %s: expected conflicts never to be deleted, found '\n                             'a DELETE', OLD.id);\n    END IF;\n    IF OLD.state <> 'open' OR NEW.current_id IS DISTINCT FROM OLD.current_id\n       OR NEW.candidate_id IS DISTINCT FROM OLD.candidate_id\n       OR NEW.created_at IS DISTINCT FROM OLD.created_at THEN\n        RAISE EXCEPTION USING ERRCODE = 'check_violation',\n            MESSAGE = format('fact conflict %s: expected only an open conflict to change, and '\n                             'only its resolution, found an UPDATE of a %s conflict', OLD.id,\n                             OLD.state);\n    END IF;\n    RETURN NEW;\n", hash='b673af415cc082acd9a0fe84bdfc69e18e67013b', operation='UPDATE OR DELETE', pgid='pgtrigger_conflict_settled_once_9ec35', table='ledger_factconflict', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='factdecision',
            trigger=pgtrigger.compiler.Trigger(name='fact_decision_append_only', sql=ledger.models.triggers.UnbypassableTriggerSql(func="RAISE EXCEPTION 'pgtrigger: Cannot update or delete rows from % table', TG_TABLE_NAME;", hash='9b3da97dddc77df007a69c2539ae3adca46c1691', operation='UPDATE OR DELETE', pgid='pgtrigger_fact_decision_append_only_62940', table='ledger_factdecision', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='obligation',
            trigger=pgtrigger.compiler.Trigger(name='obligation_settled_once', sql=ledger.models.triggers.UnbypassableTriggerSql(func="\n    IF TG_OP = 'DELETE' THEN\n        RAISE EXCEPTION USING ERRCODE = 'check_violation',\n            MESSAGE = format('obligation %s: expected obligations never to be deleted, found '\n                             'a DELETE', OLD.key);\n    END IF;\n    IF OLD.state <> 'open' THEN\n        RAISE EXCEPTION USING ERRCODE = 'check_violation',\n            MESSAGE = format('obligation %s: expected a %s obligation never to change, found '\n                             'an UPDATE', OLD.key, OLD.state);\n    END IF;\n    IF NEW.key IS DISTINCT FROM OLD.key OR NEW.run_id IS DISTINCT FROM OLD.run_id\n       OR NEW.kind IS DISTINCT FROM OLD.kind OR NEW.tenant IS DISTINCT FROM OLD.tenant\n       OR NEW.created_at IS DISTINCT FROM OLD.created_at THEN\n        RAISE EXCEPTION USING ERRCODE = 'check_violation',\n            MESSAGE = format('obligation %s: expected its key, run, kind, tenant and '\n                             'created_at to stay unchanged, found an UPDATE changing them',\n                             OLD.key);\n    END IF;\n    RETURN NEW;\n", hash='f4e7527b0e14c988b784aff50717093aa3b479b2', operation='UPDATE OR DELETE', pgid='pgtrigger_obligation_settled_once_bf6c7', table='ledger_obligation', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='operation',
            trigger=pgtrigger.compiler.Trigger(name='operation_transition_check', sql=ledger.models.triggers.UnbypassableTriggerSql(func="\n    IF NEW.operation_id IS DISTINCT FROM OLD.operation_id\n       OR NEW.tenant IS DISTINCT FROM OLD.tenant\n       OR NEW.operation IS DISTINCT FROM OLD.operation\n       OR NEW.idempotency_key IS DISTINCT FROM OLD.idempotency_key\n       OR NEW.intent_fingerprint IS DISTINCT FROM OLD.intent_fingerprint\n       OR NEW.created_at IS DISTINCT FROM OLD.created_at THEN\n        RAISE EXCEPTION USING ERRCODE = 'check_violation',\n            MESSAGE = format('operation %s: expected its identity (operation_id, tenant, '\n                             'operation, idempotency_key, intent_fingerprint, created_at) '\n                             'to stay unchanged, found an UPDATE changing it', OLD.operation_id);\n    END IF;\n    IF NEW.state IS DISTINCT FROM OLD.state THEN\n        IF (OLD.state, NEW.state) NOT IN (('manual_review', 'abandoned'), ('manual_review', 'safe_to_retry'), ('manual_review', 'succeeded'), ('outcome_unknown', 'abandoned'), ('outcome_unknown', 'reconciling'), ('outcome_unknown', 'safe_to_retry'), ('outcome_unknown', 'succeeded'), ('planned', 'abandoned'), ('planned', 'submitted'), ('reconciling', 'manual_review'), ('reconciling', 'outcome_unknown'), ('reconciling', 'safe_to_retry'), ('reconciling', 'succeeded'), ('safe_to_retry', 'abandoned'), ('safe_to_retry', 'submitted'), ('submitted', 'outcome_unknown'), ('submitted', 'rejected'), ('submitted', 'succeeded')) THEN\n            RAISE EXCEPTION USING ERRCODE = 'check_violation',\n                MESSAGE = format('illegal transition of operation %s: expected %s -> one of '\n                                 '[%s], found %s -> %s', OLD.operation_id, OLD.state,\n                                 CASE OLD.state WHEN 'abandoned' THEN 'none (terminal)' WHEN 'manual_review' THEN 'abandoned, safe_to_retry, succeeded' WHEN 'outcome_unknown' THEN 'abandoned, reconciling, safe_to_retry, succeeded' WHEN 'planned' THEN 'abandoned, submitted' WHEN 'reconciling' THEN 'manual_review, outcome_unknown, safe_to_retry, succeeded' WHEN 'rejected' THEN 'none (terminal)' WHEN 'safe_to_retry' THEN 'abandoned, submitted' WHEN 'submitted' THEN 'outcome_unknown, rejected, succeeded' WHEN 'succeeded' THEN 'none (terminal)' ELSE 'none (unknown state)' END,\n                                 OLD.state, NEW.state);\n        END IF;\n        IF NEW.version IS DISTINCT FROM OLD.version + 1 THEN\n            RAISE EXCEPTION USING ERRCODE = 'check_violation',\n                MESSAGE = format('operation %s: expected version %s with the change %s -> %s, '\n                                 'found version %s', OLD.operation_id, OLD.version + 1,\n                                 OLD.state, NEW.state, NEW.version);\n        END IF;\n    ELSIF NEW.version IS DISTINCT FROM OLD.version THEN\n        RAISE EXCEPTION USING ERRCODE = 'check_violation',\n            MESSAGE = format('operation %s: expected version %s unchanged without a state '\n                             'change, found %s', OLD.operation_id, OLD.version, NEW.version);\n    END IF;\n    RETURN NEW;\n    ", hash='589b1e2f7ae63fe07b4d432bb2a849c2d33270d0', operation='UPDATE', pgid='pgtrigger_operation_transition_check_dbca0', table='ledger_operation', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='operation',
            trigger=pgtrigger.compiler.Trigger(name='operation_insert_planned', sql=ledger.models.triggers.UnbypassableTriggerSql(func="\n                IF NEW.state <> 'planned' OR NEW.version <> 1 THEN\n                    RAISE EXCEPTION USING ERRCODE = 'check_violation',\n                        MESSAGE = format('operation %s: expected a new receipt in state planned '\n                                         'at version 1, found state %s at version %s',\n                                         NEW.operation_id, NEW.state, NEW.version);\n                END IF;\n                RETURN NEW;\n                ", hash='6db774ef0c408f0a66a84a9e5bdaaf40c121c9a0', operation='INSERT', pgid='pgtrigger_operation_insert_planned_7e402', table='ledger_operation', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='operation',
            trigger=pgtrigger.compiler.Trigger(name='operation_insert_evented', sql=ledger.models.triggers.UnbypassableTriggerSql(constraint='CONSTRAINT', func="\n    IF NOT EXISTS (SELECT 1 FROM ledger_operationevent\n                   WHERE operation_id = NEW.id AND version = NEW.version) THEN\n        RAISE EXCEPTION USING ERRCODE = 'check_violation',\n            MESSAGE = format('operation %s: expected an event recording version %s (state %s) '\n                             'in the same transaction, found none; change operations through '\n                             'ledger.receipts', NEW.operation_id, NEW.version, NEW.state);\n    END IF;\n    RETURN NULL;\n", hash='bd7e85fdd51338c6292f5485c206f11ce0b503e1', operation='INSERT', pgid='pgtrigger_operation_insert_evented_4ebce', table='ledger_operation', timing='DEFERRABLE INITIALLY DEFERRED', when='AFTER')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='operation',
            trigger=pgtrigger.compiler.Trigger(name='operation_delete_terminal_only', sql=ledger.models.triggers.UnbypassableTriggerSql(declare='DECLARE unfinished record;', func="\n    SELECT operation_id, state INTO unfinished FROM old_values\n     WHERE state NOT IN ('abandoned', 'rejected', 'succeeded') LIMIT 1;\n    IF FOUND THEN\n        RAISE EXCEPTION USING ERRCODE = 'check_violation',\n            MESSAGE = format('operation %s: expected a terminal operation (abandoned, rejected, succeeded) '\n                             'to delete, found state %s; only the retention purge removes '\n                             'operations, and never unfinished ones', unfinished.operation_id,\n                             unfinished.state);\n    END IF;\n    RETURN NULL;\n", hash='0fbda50e1147b0dbf99ab29f5df4ed46c3d215db', level='STATEMENT', operation='DELETE', pgid='pgtrigger_operation_delete_terminal_only_4840c', referencing='REFERENCING OLD TABLE AS old_values ', table='ledger_operation', when='AFTER')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='operation',
            trigger=pgtrigger.compiler.Trigger(name='operation_unchanged_when_terminal', sql=ledger.models.triggers.UnbypassableTriggerSql(condition='WHEN (OLD."state" IN (\'abandoned\', \'rejected\', \'succeeded\'))', declare='DECLARE changed text;', func="\n    SELECT string_agg(n.key, ', ' ORDER BY n.key) INTO changed\n      FROM jsonb_each(to_jsonb(NEW)) n\n     WHERE n.value IS DISTINCT FROM to_jsonb(OLD) -> n.key\n       AND n.key <> ALL (ARRAY['conflict', 'state', 'version']::text[])\n       AND (n.key <> ALL (ARRAY['intent', 'error_detail', 'redacted_at']::text[])\n            OR NOT ledger_sanctioned(TG_RELID));\n    IF changed IS NOT NULL THEN\n        RAISE EXCEPTION USING ERRCODE = 'check_violation',\n            MESSAGE = format('operation %s: expected a settled receipt (abandoned, rejected, succeeded) to '\n                             'stay as it is (only its conflict flag may change, its intent '\n                             'only through the retention redaction), found an UPDATE of %s '\n                             'in state %s', OLD.operation_id, changed, OLD.state);\n    END IF;\n    RETURN NEW;\n", hash='450e66d081874e82ad4fe64ddd20001d0a007cde', operation='UPDATE', pgid='pgtrigger_operation_unchanged_when_terminal_a12f6', table='ledger_operation', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='operation',
            trigger=pgtrigger.compiler.Trigger(name='operation_change_evented', sql=ledger.models.triggers.UnbypassableTriggerSql(condition='WHEN (OLD."state" IS DISTINCT FROM (NEW."state"))', constraint='CONSTRAINT', func="\n    IF NOT EXISTS (SELECT 1 FROM ledger_operationevent\n                   WHERE operation_id = NEW.id AND version = NEW.version) THEN\n        RAISE EXCEPTION USING ERRCODE = 'check_violation',\n            MESSAGE = format('operation %s: expected an event recording version %s (state %s) '\n                             'in the same transaction, found none; change operations through '\n                             'ledger.receipts', NEW.operation_id, NEW.version, NEW.state);\n    END IF;\n    RETURN NULL;\n", hash='20b92330ce7d7254ba73ed8247ea160f8e7a6803', operation='UPDATE', pgid='pgtrigger_operation_change_evented_f97da', table='ledger_operation', timing='DEFERRABLE INITIALLY DEFERRED', when='AFTER')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='operationevent',
            trigger=pgtrigger.compiler.Trigger(name='event_append_only', sql=ledger.models.triggers.UnbypassableTriggerSql(func="\n        IF ledger_sanctioned(TG_RELID) THEN\n            RETURN NULL;\n        END IF;\n        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',\n            MESSAGE = format('pgtrigger: Cannot update or delete rows from %s table: expected '\n                             'only INSERT (it is append-only; retention removes and redacts '\n                             'rows through ledger_retention_purge and ledger_retention_redact), '\n                             'found %s', TG_TABLE_NAME, TG_OP);\n        ", hash='6f21cdd2486de11f63432352b25f05db369806dd', level='STATEMENT', operation='UPDATE OR DELETE', pgid='pgtrigger_event_append_only_67e45', table='ledger_operationevent', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='redaction',
            trigger=pgtrigger.compiler.Trigger(name='redaction_append_only', sql=ledger.models.triggers.UnbypassableTriggerSql(func="RAISE EXCEPTION 'pgtrigger: Cannot update or delete rows from % table', TG_TABLE_NAME;", hash='d0b293220fd3a7993949136473746d67c066e928', operation='UPDATE OR DELETE', pgid='pgtrigger_redaction_append_only_4e7cc', table='ledger_redaction', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='retentionchange',
            trigger=pgtrigger.compiler.Trigger(name='retention_change_append_only', sql=ledger.models.triggers.UnbypassableTriggerSql(func="RAISE EXCEPTION 'pgtrigger: Cannot update or delete rows from % table', TG_TABLE_NAME;", hash='f3a5a5239aacb3f905832b8aefb457ddf145e676', operation='UPDATE OR DELETE', pgid='pgtrigger_retention_change_append_only_6506d', table='ledger_retentionchange', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='step',
            trigger=pgtrigger.compiler.Trigger(name='step_lifecycle_check', sql=ledger.models.triggers.UnbypassableTriggerSql(declare='DECLARE missing text;', func="\n    IF NEW.run_id IS DISTINCT FROM OLD.run_id OR NEW.step_id IS DISTINCT FROM OLD.step_id\n       OR NEW.created_at IS DISTINCT FROM OLD.created_at THEN\n        RAISE EXCEPTION USING ERRCODE = 'check_violation',\n            MESSAGE = format('step %s: expected its run, step_id and created_at to stay '\n                             'unchanged, found an UPDATE changing them', OLD.step_id);\n    END IF;\n    IF NEW.state IS DISTINCT FROM OLD.state THEN\n        IF (OLD.state, NEW.state) NOT IN (('pending', 'started'), ('started', 'committed')) THEN\n            RAISE EXCEPTION USING ERRCODE = 'check_violation',\n                MESSAGE = format('step %s: expected pending -> started -> committed, found '\n                                 '%s -> %s', OLD.step_id, OLD.state, NEW.state);\n        END IF;\n        IF NEW.state = 'started' THEN\n            SELECT string_agg(dep.step_id || ' (' || dep.state || ')', ', ' ORDER BY dep.step_id)\n              INTO missing\n              FROM ledger_step_depends_on link\n              JOIN ledger_step dep ON dep.id = link.to_step_id\n             WHERE link.from_step_id = NEW.id AND dep.state <> 'committed';\n            IF missing IS NOT NULL THEN\n                RAISE EXCEPTION USING ERRCODE = 'check_violation',\n                    MESSAGE = format('step %s: expected every dependency committed before it '\n                                     'starts, found %s', NEW.step_id, missing);\n            END IF;\n        END IF;\n    ELSIF OLD.state = 'committed' AND (NEW.started_at IS DISTINCT FROM OLD.started_at\n                                       OR NEW.committed_at IS DISTINCT FROM OLD.committed_at) THEN\n        RAISE EXCEPTION USING ERRCODE = 'check_violation',\n            MESSAGE = format('step %s: expected a committed step never to change, found an '\n                             'UPDATE of its times', OLD.step_id);\n    END IF;\n    RETURN NEW;\n", hash='103e8d3a3812b8b10c3d1ecdb4d5c9b913cb0551', operation='UPDATE', pgid='pgtrigger_step_lifecycle_check_9b2c4', table='ledger_step', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='tenantaccesschange',
            trigger=pgtrigger.compiler.Trigger(name='tenant_access_change_append_only', sql=ledger.models.triggers.UnbypassableTriggerSql(func="RAISE EXCEPTION 'pgtrigger: Cannot update or delete rows from % table', TG_TABLE_NAME;", hash='2167e378808f83aa496a107c49f293146daf4823', operation='UPDATE OR DELETE', pgid='pgtrigger_tenant_access_change_append_only_46918', table='ledger_tenantaccesschange', when='BEFORE')),
        ),
    ]
