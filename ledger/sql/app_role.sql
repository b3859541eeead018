-- Agent Ledger: the application role, with only the rights the application uses.
--
-- Independent of migrations: run it after `manage.py migrate` (and again after later
-- migrations add tables or columns), as the role that owns the tables, e.g.
--
--   psql "$DATABASE_URL" -c "SET ledger.app_role = 'ledger_app'" -f ledger/sql/app_role.sql
--
-- or `manage.py app_role --role ledger_app`, which runs this file. The role is NOLOGIN;
-- give it to the account the web server and agents use:
--
--   CREATE ROLE ledger_web LOGIN PASSWORD '...' IN ROLE ledger_app;
--
-- Each run first takes every right the role has on the schema's tables, sequences and
-- functions away, then grants exactly what is below: whatever an older version of this
-- file granted is gone. What the role gets:
--
-- * SELECT on every table, USAGE on every sequence;
-- * on the ledger's tables, the writes `LEDGER_WRITES` lists, no more: no UPDATE or DELETE
--   on the audit tables (append-only: events, evidence, decisions, the change logs), no
--   DELETE of operations, UPDATE of an operation only on the columns its transitions set
--   (never its identity, intent or target), no INSERT into the rows only retention writes
--   (ChainAnchor, Redaction). A ledger table missing from `LEDGER_WRITES` stops the script:
--   decide its rights when you add it;
-- * on the framework's tables (auth, sessions, admin log, axes), ordinary writes; on
--   django_migrations, none;
-- * EXECUTE on the two retention functions of migration 0014, the only way anyone but the
--   owner removes events and evidence or redacts a settled receipt, and on the state purge
--   of migration 0035 (superseded facts, episodes, settled obligations); they audit
--   themselves;
--   and on the sealer's `ledger_seal_events` (migration 0025) and `ledger_seal_links`
--   (0049), the only way a link's chain position and hash are set (once, on an unsealed
--   event, fact decision or record link); on the lease functions
--   and the workers' lock of migration 0042, the only way a lease changes or a worker's
--   lock is taken;
-- * never TRUNCATE, REFERENCES or TRIGGER, never CREATE on the schema, never ownership; the
--   script refuses a role that is a superuser, owns ledger tables or is a member of their
--   owner (it could switch the rules off).
--
-- `manage.py purge` and `manage.py verify_audit` work under the role; `manage.py migrate`
-- and this script need the owning role.
DO $app_role$
DECLARE
    app_role text := current_setting('ledger.app_role');
    writes text;
    ledger_table text;
    other_table text;
    -- table => its writes, as GRANT takes them. Reads are granted on every table.
    ledger_writes CONSTANT jsonb := jsonb_build_object(
        -- receipts: the columns ledger.transitions sets; the rest never changes (intent and
        -- its fingerprint: an approver's edit of a planned intent, which the transition
        -- trigger admits only with a person's approval of exactly that fingerprint)
        'ledger_operation', 'INSERT, UPDATE (state, version, state_changed_at, conflict, '
            'attempt, external_id, error_code, error_detail, submitted_at, in_flight_until, '
            'completed_at, unknown_since, next_attempt_at, reconcile_attempts, '
            'reconcile_failures, result, result_unstorable, reread_due_at, intent, '
            'intent_fingerprint)',
        -- append-only: the audit trail
        'ledger_operationevent', 'INSERT',
        'ledger_evidence', 'INSERT',
        'ledger_factdecision', 'INSERT',
        'ledger_episode', 'INSERT',
        'ledger_retentionchange', 'INSERT',
        'ledger_tenantaccesschange', 'INSERT',
        'ledger_agentkeychange', 'INSERT',
        'ledger_auditverification', 'INSERT',
        'ledger_approval', 'INSERT',
        'ledger_resolutionproposal', 'INSERT',
        'ledger_approvalpolicychange', 'INSERT',
        'ledger_unknownoutcomepolicychange', 'INSERT',
        'ledger_operationnote', 'INSERT',
        'ledger_notificationchannelchange', 'INSERT',
        'ledger_deliveryattempt', 'INSERT',
        'ledger_coveragereading', 'INSERT',
        -- written only by ledger_retention_purge / ledger_retention_redact
        'ledger_chainanchor', '',
        'ledger_redaction', '',
        -- signed chain heads: manage.py audit_export, as the tables' owner
        'ledger_auditcheckpoint', '',
        -- the chains' heads move in the sealer's ledger_seal_events and ledger_seal_links
        'ledger_chainhead', '',
        -- the records chain: written by PostgreSQL's trigger ledger_record_link alone
        'ledger_recordlink', '',
        -- retention: policies are the desk's; a run's counts are written by the purge
        'ledger_retentionpolicy', 'INSERT, UPDATE, DELETE',
        'ledger_stateretentionpolicy', 'INSERT, UPDATE, DELETE',
        -- (policy_id: deleting a policy empties it in its runs)
        'ledger_purgerun', 'INSERT, UPDATE (operations_purged, events_purged, '
            'evidence_purged, operations_redacted, evidence_redacted, first_operation_id, '
            'last_operation_id, finished_at, policy_id, state_policy_id, rows_purged)',
        -- approvals: policies are the desk's; a request's status follows the decisions
        'ledger_approvalpolicy', 'INSERT, UPDATE',
        -- unknown-outcome policies: the desk's (admins); the reconciler reads them
        'ledger_unknownoutcomepolicy', 'INSERT, UPDATE (automatic_retry, attempts, '
            'not_yet_window, updated_by_id, updated_at)',
        'ledger_approvalrequest', 'INSERT, UPDATE (tenant, note, requested_by, '
            'approvals_needed, status, requested_at, decided_at)',
        -- notifications: channels are the desk's (never deleted: disabled); a batch's
        -- status follows its attempts; what was told is deleted only with its operation
        'ledger_notificationchannel', 'INSERT, UPDATE (is_active, updated_by_id, updated_at)',
        'ledger_notificationbatch', 'INSERT, UPDATE (counts, item_count, payload, status, '
            'attempts, next_attempt_at, last_error, delivered_at)',
        'ledger_notificationsent', 'INSERT',
        -- the desk's search: written only by the triggers on operations (migration 0051)
        'ledger_operationsearch', '',
        -- the desk: a reviewer's claim is taken over in place when expired, and released
        'ledger_claim', 'INSERT, UPDATE (claimed_by_id, claimed_by_name, claimed_at, '
            'expires_at), DELETE',
        -- the desk: a person's saved queue filters, replaced or deleted by their owner
        'ledger_savedview', 'INSERT, UPDATE (owner_name, filters, updated_at), DELETE',
        -- execution state: their triggers allow each row's one-way moves only
        'ledger_fact', 'INSERT, UPDATE (status, superseded_by_id)',
        'ledger_factconflict', 'INSERT, UPDATE (state, resolved_at, resolved_by_id, '
            'resolution_reason, chosen_id, resolved_fact_id)',
        'ledger_obligation', 'INSERT, UPDATE (state, result, committed_at, cancelled_at, '
            'cancel_reason)',
        'ledger_run', 'INSERT',
        'ledger_step', 'INSERT, UPDATE (state, started_at, committed_at)',
        'ledger_step_depends_on', 'INSERT',
        -- leases: through ledger_lease_acquire / _renew / _release only (the column's
        -- UPDATE lets the fences share-lock a lease; lease_change_check refuses it)
        'ledger_lease', 'UPDATE (acquired_at)',
        -- the workers' locks: through ledger_worker_lock only
        'ledger_workerlock', '',
        -- people and keys
        'ledger_tenantaccess', 'INSERT, DELETE',
        -- the tenants of a tenant-limited login (manage.py db_roles --tenants): the owner's
        'ledger_logintenant', '',
        'ledger_agentkey', 'INSERT, UPDATE (revoked_at, revoked_by_name)'
    );
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = app_role) THEN
        EXECUTE format('CREATE ROLE %I NOLOGIN', app_role);
    END IF;
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = app_role AND (rolsuper OR rolbypassrls))
       OR EXISTS (SELECT FROM pg_tables WHERE schemaname = 'public'
                   AND tablename LIKE 'ledger\_%'
                   AND pg_has_role(app_role, tableowner, 'MEMBER')) THEN
        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',
            MESSAGE = format('expected an application role that is no superuser and neither '
                             'owns the ledger''s tables nor is a member of their owner, found '
                             '%s, which could switch the ledger''s rules off', app_role);
    END IF;
    EXECUTE format('REVOKE ALL ON ALL TABLES IN SCHEMA public FROM %I', app_role);
    EXECUTE format('REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM %I', app_role);
    EXECUTE format('REVOKE ALL ON ALL FUNCTIONS IN SCHEMA public FROM %I', app_role);
    EXECUTE format('REVOKE CREATE ON SCHEMA public FROM %I', app_role);
    EXECUTE format('GRANT USAGE ON SCHEMA public TO %I', app_role);
    EXECUTE format('GRANT SELECT ON ALL TABLES IN SCHEMA public TO %I', app_role);
    EXECUTE format('GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO %I', app_role);
    FOR ledger_table IN
        SELECT tablename FROM pg_tables
         WHERE schemaname = 'public' AND tablename LIKE 'ledger\_%' ORDER BY tablename
    LOOP
        writes := ledger_writes ->> ledger_table;
        IF writes IS NULL THEN
            RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
                MESSAGE = format('expected every ledger table in app_role.sql''s ledger_writes, '
                                 'found %s missing: decide what the application may write '
                                 'to it', ledger_table);
        END IF;
        IF writes <> '' THEN
            EXECUTE format('GRANT %s ON %I TO %I', writes, ledger_table, app_role);
        END IF;
    END LOOP;
    FOR other_table IN
        SELECT tablename FROM pg_tables
         WHERE schemaname = 'public' AND tablename NOT LIKE 'ledger\_%'
           AND tablename <> 'django_migrations'
    LOOP
        EXECUTE format('GRANT INSERT, UPDATE, DELETE ON %I TO %I', other_table, app_role);
    END LOOP;
    EXECUTE format('GRANT EXECUTE ON FUNCTION ledger_retention_purge(bigint, bigint[]) TO %I',
                   app_role);
    EXECUTE format('GRANT EXECUTE ON FUNCTION ledger_retention_redact(bigint, bigint[]) TO %I',
                   app_role);
    EXECUTE format('GRANT EXECUTE ON FUNCTION ledger_retention_purge_state(bigint, bigint[]) '
                   'TO %I', app_role);
    EXECUTE format('GRANT EXECUTE ON FUNCTION ledger_seal_events(varchar, bigint[], varchar[], '
                   'bigint, varchar) TO %I', app_role);
    EXECUTE format('GRANT EXECUTE ON FUNCTION ledger_seal_links(varchar, varchar, bigint[], '
                   'varchar[], bigint, varchar) TO %I', app_role);
    EXECUTE format('GRANT EXECUTE ON FUNCTION ledger_lease_acquire(text, text, interval), '
                   'ledger_lease_renew(text, text, bigint, interval), '
                   'ledger_lease_release(text, text, bigint), ledger_worker_lock(text) TO %I',
                   app_role);
END
$app_role$;
