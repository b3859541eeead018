-- Agent Ledger: an application role that cannot alter the audit trail.
--
-- Independent of migrations: run it after `manage.py migrate` (and again after later
-- migrations add tables), as the role that owns the tables, e.g.
--
--   psql "$DATABASE_URL" -c "SET ledger.app_role = 'ledger_app'" -f ledger/sql/app_role.sql
--
-- or `manage.py app_role --role ledger_app`, which runs this file. The role is NOLOGIN;
-- give it to the account the web server and agents use:
--
--   CREATE ROLE ledger_web LOGIN PASSWORD '...' IN ROLE ledger_app;
--
-- The role may read everything and insert, update and delete ordinary rows, but it holds
-- no UPDATE, DELETE or TRUNCATE on the audit tables below, so PostgreSQL refuses to alter
-- them even if the append-only triggers were dropped. `manage.py purge` and
-- `manage.py migrate` need those rights: run them as the owning role.
DO $app_role$
DECLARE
    app_role text := current_setting('ledger.app_role');
    audit_table text;
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = app_role) THEN
        EXECUTE format('CREATE ROLE %I NOLOGIN', app_role);
    END IF;
    EXECUTE format('GRANT USAGE ON SCHEMA public TO %I', app_role);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO %I',
                   app_role);
    EXECUTE format('GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO %I', app_role);
    EXECUTE format('REVOKE TRUNCATE, REFERENCES, TRIGGER ON ALL TABLES IN SCHEMA public FROM %I',
                   app_role);
    FOREACH audit_table IN ARRAY ARRAY[
        -- audit tables: append-only for the application
        'ledger_operationevent',
        'ledger_evidence',
        'ledger_retentionchange',
        'ledger_redaction',
        'ledger_chainanchor',
        'ledger_factdecision',
        'ledger_episode',
        'ledger_tenantaccesschange',
        'ledger_agentkeychange',
        'ledger_approval',
        'ledger_approvalpolicychange'
    ] LOOP
        EXECUTE format('REVOKE UPDATE, DELETE, TRUNCATE ON %I FROM %I', audit_table, app_role);
    END LOOP;
END
$app_role$;
