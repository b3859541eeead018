"""The desk's search by fragment leaves the operations table: the strings it looks inside
(the operation id, the idempotency key, the external id) move to `ledger_operationsearch`,
which carries the trigram index; `operation_search_idx` (migration 0032) is dropped.

Why: that index was an expression over the operation's row, so every transition that
could not update the row in place (most of them: the state is indexed) wrote the row's
trigrams into the GIN index again, three times a lifecycle, for strings that never change
but the external id. Here an operation's id and key are written once, at insert, and its
external id once, when it is set; a transition touches nothing here.

PostgreSQL writes the rows, so no writer can skip or forge them: AFTER triggers on
`ledger_operation` (INSERT; UPDATE of the id, key, tenant or external id, which only the
external id's moves do in practice; DELETE, per statement, so a purge batch removes its
rows in one statement) call SECURITY DEFINER functions owned by the tables' owner. No role
holds a write grant on the table (ledger.db_roles, ledger/sql/app_role.sql): every role
reads it, as it reads operations.
"""

import django.db.models.deletion
from django.db import migrations, models

_FUNCTIONS = r"""
CREATE OR REPLACE FUNCTION ledger_operation_search_write() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = public, pg_temp
AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO ledger_operationsearch (operation_id, kind, tenant, text)
        VALUES (NEW.id, 'receipt', NEW.tenant,
                NEW.operation_id || E'\x1f' || NEW.idempotency_key);
        IF NEW.external_id <> '' THEN
            INSERT INTO ledger_operationsearch (operation_id, kind, tenant, text)
            VALUES (NEW.id, 'external', NEW.tenant, NEW.external_id);
        END IF;
        RETURN NULL;
    END IF;
    -- An UPDATE that changed one of them (the trigger's WHEN): in practice the external
    -- id, set once when the external system confirms the call.
    IF (NEW.operation_id, NEW.idempotency_key, NEW.tenant)
       IS DISTINCT FROM (OLD.operation_id, OLD.idempotency_key, OLD.tenant) THEN
        INSERT INTO ledger_operationsearch (operation_id, kind, tenant, text)
        VALUES (NEW.id, 'receipt', NEW.tenant,
                NEW.operation_id || E'\x1f' || NEW.idempotency_key)
        ON CONFLICT (operation_id, kind)
        DO UPDATE SET tenant = EXCLUDED.tenant, text = EXCLUDED.text;
    END IF;
    IF NEW.external_id = '' THEN
        DELETE FROM ledger_operationsearch
         WHERE operation_id = NEW.id AND kind = 'external';
    ELSIF OLD.external_id = '' AND NEW.tenant = OLD.tenant THEN
        INSERT INTO ledger_operationsearch (operation_id, kind, tenant, text)
        VALUES (NEW.id, 'external', NEW.tenant, NEW.external_id);
    ELSE
        INSERT INTO ledger_operationsearch (operation_id, kind, tenant, text)
        VALUES (NEW.id, 'external', NEW.tenant, NEW.external_id)
        ON CONFLICT (operation_id, kind)
        DO UPDATE SET tenant = EXCLUDED.tenant, text = EXCLUDED.text;
    END IF;
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION ledger_operation_search_forget() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = public, pg_temp
AS $$
BEGIN
    DELETE FROM ledger_operationsearch s USING gone
     WHERE s.operation_id = gone.id;
    RETURN NULL;
END
$$;

CREATE TRIGGER ledger_operation_search_insert AFTER INSERT ON ledger_operation
    FOR EACH ROW EXECUTE FUNCTION ledger_operation_search_write();
CREATE TRIGGER ledger_operation_search_update
    AFTER UPDATE OF operation_id, idempotency_key, tenant, external_id ON ledger_operation
    FOR EACH ROW
    WHEN (OLD.external_id IS DISTINCT FROM NEW.external_id
          OR OLD.operation_id IS DISTINCT FROM NEW.operation_id
          OR OLD.idempotency_key IS DISTINCT FROM NEW.idempotency_key
          OR OLD.tenant IS DISTINCT FROM NEW.tenant)
    EXECUTE FUNCTION ledger_operation_search_write();
CREATE TRIGGER ledger_operation_search_delete AFTER DELETE ON ledger_operation
    REFERENCING OLD TABLE AS gone
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_operation_search_forget();

INSERT INTO ledger_operationsearch (operation_id, kind, tenant, text)
SELECT id, 'receipt', tenant, operation_id || E'\x1f' || idempotency_key
  FROM ledger_operation;
INSERT INTO ledger_operationsearch (operation_id, kind, tenant, text)
SELECT id, 'external', tenant, external_id FROM ledger_operation WHERE external_id <> '';

CREATE INDEX operation_search_text_idx ON ledger_operationsearch
    USING gin (text gin_trgm_ops);
DROP INDEX IF EXISTS operation_search_idx;
"""

_UNDO = r"""
DROP TRIGGER IF EXISTS ledger_operation_search_insert ON ledger_operation;
DROP TRIGGER IF EXISTS ledger_operation_search_update ON ledger_operation;
DROP TRIGGER IF EXISTS ledger_operation_search_delete ON ledger_operation;
DROP FUNCTION IF EXISTS ledger_operation_search_write();
DROP FUNCTION IF EXISTS ledger_operation_search_forget();
CREATE INDEX IF NOT EXISTS operation_search_idx ON ledger_operation
    USING gin ((operation_id::text || E'\x1f' || idempotency_key::text
                || E'\x1f' || external_id::text) gin_trgm_ops);
"""


class Migration(migrations.Migration):

    dependencies = [
        ('ledger', '0050_fence_rows_added_to_a_leased_run'),
    ]

    operations = [
        migrations.CreateModel(
            name='OperationSearch',
            fields=[
                ('pk', models.CompositePrimaryKey('operation_id', 'kind', blank=True, editable=False, primary_key=True, serialize=False)),
                ('kind', models.CharField(choices=[('receipt', 'The operation id and the idempotency key'), ('external', 'The external id')], max_length=10)),
                ('tenant', models.CharField(max_length=100)),
                ('text', models.TextField()),
                ('operation', models.ForeignKey(db_constraint=False, db_index=False, on_delete=django.db.models.deletion.DO_NOTHING, related_name='+', to='ledger.operation')),
            ],
        ),
        migrations.RunSQL(_FUNCTIONS, _UNDO),
    ]
