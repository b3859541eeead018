"""Every row people rely on beside the operations is under a chain (ledger.chain_content):
each INSERT, UPDATE and DELETE of an approval policy or its change, an approval request, an
approval, a resolution proposal, a desk note, a tenant grant or its change, a fact, a fact
conflict or a fact decision appends a RecordLink, written by PostgreSQL alone (the trigger
`ledger_record_link`, SECURITY DEFINER: no role writes links itself) with the row's content
as PostgreSQL computes it (`ledger_record_content`); every row stored today gets its link
now. The sealer links records and fact decisions into their tenant's chains through
`ledger_seal_links`, as it links operation events: a fact decision's chain_seq and chain_hash
are no longer the writer's."""

import django.db.models.functions.datetime
import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations, models

import ledger.models.triggers

# Frozen copy of ledger.chain_content.RECORD_SOURCES as of this migration.
SOURCES = {
    "approval_policy": "ledger_approvalpolicy",
    "approval_policy_change": "ledger_approvalpolicychange",
    "approval_request": "ledger_approvalrequest",
    "approval": "ledger_approval",
    "resolution_proposal": "ledger_resolutionproposal",
    "operation_note": "ledger_operationnote",
    "tenant_access": "ledger_tenantaccess",
    "tenant_access_change": "ledger_tenantaccesschange",
    "fact": "ledger_fact",
    "fact_conflict": "ledger_factconflict",
    "fact_decision": "ledger_factdecision",
}

NO_UPDATE = {"fact_decision"}

RECORD_FUNCTIONS = """
-- A row's content as a record link holds it: per column, the sha256 of the value's jsonb
-- text, in UTC whatever the session's time zone; a fact decision's own link left out.
CREATE OR REPLACE FUNCTION ledger_record_content(r anyelement) RETURNS jsonb
LANGUAGE sql STABLE
SET search_path = public, pg_temp
SET TimeZone = 'UTC'
AS $$
    SELECT coalesce(jsonb_object_agg(key, encode(sha256(convert_to(value::text, 'UTF8')),
                                                 'hex')), '{}'::jsonb)
      FROM jsonb_each(to_jsonb(r) - 'chain_seq' - 'chain_hash')
$$;

CREATE OR REPLACE FUNCTION ledger_record_link() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = public, pg_temp
AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        INSERT INTO ledger_recordlink (tenant, source, row_id, action, content, before,
                                       created_at)
        VALUES (OLD.tenant, TG_ARGV[0], OLD.id, 'delete', NULL, ledger_record_content(OLD),
                now());
    ELSIF TG_OP = 'UPDATE' THEN
        INSERT INTO ledger_recordlink (tenant, source, row_id, action, content, before,
                                       created_at)
        VALUES (NEW.tenant, TG_ARGV[0], NEW.id, 'update', ledger_record_content(NEW),
                ledger_record_content(OLD), now());
    ELSE
        INSERT INTO ledger_recordlink (tenant, source, row_id, action, content, created_at)
        VALUES (NEW.tenant, TG_ARGV[0], NEW.id, 'insert', ledger_record_content(NEW), now());
    END IF;
    RETURN NULL;
END;
$$;
REVOKE ALL ON FUNCTION ledger_record_link() FROM PUBLIC;

-- The sealer's links of the chains beside the operation events ("fact_decisions",
-- "records"): as ledger_seal_events (migration 0025) does for events.
CREATE OR REPLACE FUNCTION ledger_seal_links(
    seal_chain varchar, seal_tenant varchar, row_ids bigint[], hashes varchar[],
    prev_seq bigint, prev_hash varchar)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = public, pg_temp
SET ledger.sanctioned = 'seal'
AS $$
DECLARE
    head ledger_chainhead;
    sealed integer;
BEGIN
    IF seal_chain IS NULL OR seal_chain NOT IN ('fact_decisions', 'records') THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('expected the chain fact_decisions or records, found %s',
                             coalesce(seal_chain, 'NULL'));
    END IF;
    IF coalesce(cardinality(row_ids), 0) = 0
       OR cardinality(row_ids) IS DISTINCT FROM cardinality(hashes) THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('expected as many hashes as rows to seal, at least one, '
                             'found %s rows and %s hashes', coalesce(cardinality(row_ids), 0),
                             coalesce(cardinality(hashes), 0));
    END IF;
    INSERT INTO ledger_chainhead (chain, tenant, seq, hash)
    VALUES (seal_chain, seal_tenant, 0, repeat('0', 64))
    ON CONFLICT (chain, tenant) DO NOTHING;
    SELECT * INTO head FROM ledger_chainhead
     WHERE chain = seal_chain AND tenant = seal_tenant FOR UPDATE;
    IF head.seq IS DISTINCT FROM prev_seq OR head.hash IS DISTINCT FROM prev_hash THEN
        RAISE EXCEPTION USING ERRCODE = 'serialization_failure',
            MESSAGE = format('expected the chain head of %s/%s at %s:%s, where the sealer '
                             'linked from, found %s:%s (another sealer moved it)', seal_chain,
                             seal_tenant, prev_seq, prev_hash, head.seq, head.hash);
    END IF;
    IF seal_chain = 'records' THEN
        UPDATE ledger_recordlink r
           SET chain_seq = prev_seq + s.n, chain_hash = s.hash
          FROM unnest(row_ids, hashes) WITH ORDINALITY AS s(id, hash, n)
         WHERE r.id = s.id AND r.tenant = seal_tenant AND r.chain_seq IS NULL;
    ELSE
        UPDATE ledger_factdecision d
           SET chain_seq = prev_seq + s.n, chain_hash = s.hash
          FROM unnest(row_ids, hashes) WITH ORDINALITY AS s(id, hash, n)
         WHERE d.id = s.id AND d.tenant = seal_tenant AND d.chain_seq IS NULL;
    END IF;
    GET DIAGNOSTICS sealed = ROW_COUNT;
    IF sealed <> cardinality(row_ids) THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('expected %s unsealed rows of %s/%s to seal, found %s',
                             cardinality(row_ids), seal_chain, seal_tenant, sealed);
    END IF;
    UPDATE ledger_chainhead SET seq = prev_seq + sealed, hash = hashes[sealed]
     WHERE id = head.id;
    RETURN prev_seq + sealed;
END;
$$;
REVOKE ALL ON FUNCTION ledger_seal_links(varchar, varchar, bigint[], varchar[], bigint,
                                         varchar) FROM PUBLIC;
"""


def _triggers_and_links(sources: dict[str, str]) -> str:
    sql = []
    for source, table in sources.items():
        # A fact decision's one UPDATE is the sealer's of its own link (fact_decision_sealed_once
        # refuses every other): no content changes, no link.
        update = "" if source in NO_UPDATE else f"""
CREATE TRIGGER ledger_record_link_update AFTER UPDATE ON {table}
    FOR EACH ROW WHEN (OLD.* IS DISTINCT FROM NEW.*)
    EXECUTE FUNCTION ledger_record_link('{source}');"""
        sql.append(f"""
CREATE TRIGGER ledger_record_link AFTER INSERT OR DELETE ON {table}
    FOR EACH ROW EXECUTE FUNCTION ledger_record_link('{source}');{update}
INSERT INTO ledger_recordlink (tenant, source, row_id, action, content, created_at)
SELECT t.tenant, '{source}', t.id, 'insert', ledger_record_content(t), now()
  FROM {table} t ORDER BY t.id;""")
    return "\n".join(sql)


def _drop_triggers(sources: dict[str, str]) -> str:
    return "\n".join(f"DROP TRIGGER IF EXISTS ledger_record_link ON {table};\n"
                     f"DROP TRIGGER IF EXISTS ledger_record_link_update ON {table};"
                     for table in sources.values())


# The links of the rows stored now are written here, by the owner: the trigger that refuses
# a direct INSERT is off for those statements alone.
BACKFILL_GUARD = "pgtrigger_record_link_written_by_postgres_2e909"
FORWARD = (RECORD_FUNCTIONS
           + f"ALTER TABLE ledger_recordlink DISABLE TRIGGER {BACKFILL_GUARD};\n"
           + _triggers_and_links(SOURCES)
           + f"\nALTER TABLE ledger_recordlink ENABLE TRIGGER {BACKFILL_GUARD};\n")
BACKWARD = (_drop_triggers(SOURCES) + """
DROP FUNCTION IF EXISTS ledger_seal_links(varchar, varchar, bigint[], varchar[], bigint, varchar);
DROP FUNCTION IF EXISTS ledger_record_link();
DROP FUNCTION IF EXISTS ledger_record_content(anyelement);
""")


class Migration(migrations.Migration):

    dependencies = [
        ('ledger', '0048_login_tenants'),
    ]

    operations = [
        migrations.CreateModel(
            name='RecordLink',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('tenant', models.CharField(max_length=100)),
                ('source', models.CharField(max_length=40)),
                ('row_id', models.BigIntegerField()),
                ('action', models.CharField(max_length=10)),
                ('content', models.JSONField(blank=True, null=True)),
                ('before', models.JSONField(blank=True, null=True)),
                ('created_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
                ('chain_seq', models.BigIntegerField(blank=True, null=True)),
                ('chain_hash', models.CharField(blank=True, max_length=64, null=True)),
            ],
            options={
                'ordering': ['id'],
            },
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name='factdecision',
            name='fact_decision_append_only',
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='factdecision',
            trigger=pgtrigger.compiler.Trigger(name='fact_decision_append_only', sql=ledger.models.triggers.UnbypassableTriggerSql(func="\n        IF ledger_sanctioned(TG_RELID) OR (TG_OP = 'UPDATE' AND ledger_sealing(TG_RELID)) THEN\n            RETURN NULL;\n        END IF;\n        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',\n            MESSAGE = format('pgtrigger: Cannot update or delete rows from %s table: expected '\n                             'only INSERT (it is append-only; retention removes and redacts '\n                             'rows through ledger_retention_purge and ledger_retention_redact), '\n                             'found %s', TG_TABLE_NAME, TG_OP);\n        ", hash='265e518d9e2d6fcaa899a080af18eff17dccbce7', level='STATEMENT', operation='UPDATE OR DELETE', pgid='pgtrigger_fact_decision_append_only_62940', table='ledger_factdecision', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='factdecision',
            trigger=pgtrigger.compiler.Trigger(name='fact_decision_sealed_once', sql=ledger.models.triggers.UnbypassableTriggerSql(func="\n    IF OLD.chain_seq IS NOT NULL OR NEW.chain_seq IS NULL OR to_jsonb(NEW) - 'chain_seq' - 'chain_hash' IS DISTINCT FROM to_jsonb(OLD) - 'chain_seq' - 'chain_hash' THEN\n        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',\n            MESSAGE = format('fact decision %s: expected the sealer to set an unsealed row''s '\n                             'chain_seq and chain_hash and nothing else, found chain_seq '\n                             '%s -> %s and other columns %s', OLD.id,\n                             COALESCE(OLD.chain_seq::text, 'unset'),\n                             COALESCE(NEW.chain_seq::text, 'unset'),\n                             CASE WHEN to_jsonb(NEW) - 'chain_seq' - 'chain_hash' IS DISTINCT FROM to_jsonb(OLD) - 'chain_seq' - 'chain_hash'\n                                  THEN 'changed' ELSE 'unchanged' END);\n    END IF;\n    RETURN NEW;\n", hash='ecda877d496dd7e024aedb4b8389b5a8f018cbfc', operation='UPDATE', pgid='pgtrigger_fact_decision_sealed_once_f4694', table='ledger_factdecision', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='factdecision',
            trigger=pgtrigger.compiler.Trigger(name='fact_decision_chain_columns', sql=ledger.models.triggers.UnbypassableTriggerSql(func="\n    IF NEW.chain_seq IS NOT NULL OR NEW.chain_hash IS DISTINCT FROM '' THEN\n        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',\n            MESSAGE = format('fact decision of tenant %s: expected it written unsealed (chain_seq '\n                             'and chain_hash unset: only the sealer links it, through '\n                             'ledger_seal_links), found chain_seq %s',\n                             NEW.tenant, COALESCE(NEW.chain_seq::text, 'NULL'));\n    END IF;\n    RETURN NEW;\n", hash='4574e33ffe0d07452363a9fab891a1c2dce6dbd2', operation='INSERT', pgid='pgtrigger_fact_decision_chain_columns_7f87f', table='ledger_factdecision', when='BEFORE')),
        ),
        migrations.AddIndex(
            model_name='recordlink',
            index=models.Index(fields=['source', 'row_id', 'id'], name='record_link_row_idx'),
        ),
        migrations.AddIndex(
            model_name='recordlink',
            index=models.Index(condition=models.Q(('chain_seq__isnull', True)), fields=['tenant', 'id'], name='record_link_unsealed_idx'),
        ),
        migrations.AddConstraint(
            model_name='recordlink',
            constraint=models.UniqueConstraint(fields=('tenant', 'chain_seq'), name='record_link_chain_seq_unique'),
        ),
        migrations.AddConstraint(
            model_name='recordlink',
            constraint=models.CheckConstraint(condition=models.Q(('action__in', ['insert', 'update', 'delete'])), name='record_link_action_known'),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='recordlink',
            trigger=pgtrigger.compiler.Trigger(name='record_link_append_only', sql=ledger.models.triggers.UnbypassableTriggerSql(func="\n        IF ledger_sanctioned(TG_RELID) OR (TG_OP = 'UPDATE' AND ledger_sealing(TG_RELID)) THEN\n            RETURN NULL;\n        END IF;\n        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',\n            MESSAGE = format('pgtrigger: Cannot update or delete rows from %s table: expected '\n                             'only INSERT (it is append-only; retention removes and redacts '\n                             'rows through ledger_retention_purge and ledger_retention_redact), '\n                             'found %s', TG_TABLE_NAME, TG_OP);\n        ", hash='e9f60d705d21906ce9303f3c3f938531ab6fa601', level='STATEMENT', operation='UPDATE OR DELETE', pgid='pgtrigger_record_link_append_only_6f8a0', table='ledger_recordlink', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='recordlink',
            trigger=pgtrigger.compiler.Trigger(name='record_link_sealed_once', sql=ledger.models.triggers.UnbypassableTriggerSql(func="\n    IF OLD.chain_seq IS NOT NULL OR NEW.chain_seq IS NULL OR to_jsonb(NEW) - 'chain_seq' - 'chain_hash' IS DISTINCT FROM to_jsonb(OLD) - 'chain_seq' - 'chain_hash' THEN\n        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',\n            MESSAGE = format('record link %s: expected the sealer to set an unsealed row''s '\n                             'chain_seq and chain_hash and nothing else, found chain_seq '\n                             '%s -> %s and other columns %s', OLD.id,\n                             COALESCE(OLD.chain_seq::text, 'unset'),\n                             COALESCE(NEW.chain_seq::text, 'unset'),\n                             CASE WHEN to_jsonb(NEW) - 'chain_seq' - 'chain_hash' IS DISTINCT FROM to_jsonb(OLD) - 'chain_seq' - 'chain_hash'\n                                  THEN 'changed' ELSE 'unchanged' END);\n    END IF;\n    RETURN NEW;\n", hash='fea1da585ec4d85b5c4ad2cc3059360e2362d70b', operation='UPDATE', pgid='pgtrigger_record_link_sealed_once_bc921', table='ledger_recordlink', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='recordlink',
            trigger=pgtrigger.compiler.Trigger(name='record_link_written_by_postgres', sql=ledger.models.triggers.UnbypassableTriggerSql(func="\n    IF pg_trigger_depth() < 2 THEN\n        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',\n            MESSAGE = format('record link of %s %s (tenant %s): expected it written by '\n                             'PostgreSQL (the trigger ledger_record_link of the row''s table), '\n                             'found a direct INSERT', NEW.source, NEW.row_id, NEW.tenant);\n    END IF;\n\n    IF NEW.chain_seq IS NOT NULL OR NEW.chain_hash IS DISTINCT FROM NULL THEN\n        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',\n            MESSAGE = format('record link of tenant %s: expected it written unsealed (chain_seq '\n                             'and chain_hash unset: only the sealer links it, through '\n                             'ledger_seal_links), found chain_seq %s',\n                             NEW.tenant, COALESCE(NEW.chain_seq::text, 'NULL'));\n    END IF;\n    RETURN NEW;\n", hash='21f8b6de80ff45513cbd15e9783dce7d62f41628', operation='INSERT', pgid='pgtrigger_record_link_written_by_postgres_2e909', table='ledger_recordlink', when='BEFORE')),
        ),
        migrations.RunSQL(FORWARD, BACKWARD),
    ]
