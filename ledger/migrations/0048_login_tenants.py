"""Logins limited to tenants (`manage.py db_roles --login NAME=agent --tenants acme,globex`).

- `ledger_logintenant(login, tenant)`: which tenants a login may touch. Written by the
  tables' owner only (`ledger.db_roles.ensure_login`); no role holds a write on it, and a
  login reads only its own rows.
- `ledger_login_tenants()`: the tenants this session may touch, NULL for all. A session is
  limited by each of its session user (the login: `SET ROLE` cannot shed it) and its
  current user (an owner's `SET ROLE acme_agent` acts as that login) that has rows, to the
  tenants they share. The table is schema-qualified: a temporary table of the same name
  cannot stand in for it.
- `ledger_operation_seen(id)`, `_run_seen`, `_step_seen`, `_fact_seen`: whether this
  session sees a parent row (through the parent's own policy), for the policies of the
  rows that name one.
- `ledger_lease_tenant_may(resource, tenants)`: whether a lease belongs to one of
  `tenants`: a run's lease (`run:<tenant>:<run_id>`) to its run's tenant; a reconciler's
  (`reconcile:<operation_id>`) to none of an agent's; any other name to no tenant at all.
  The lease functions run as the owner, past row-level security: `lease_tenant_check`
  refuses them, and any write of a lease, for a limited session and a lease not its own.
- `event_tenant_check`: an event's tenant is its operation's (at commit: an operation and
  its first event are written by one statement, whose parts cannot see each other, so the
  policy of events checks the event's own tenant and this trigger the rest).
- `ledger_unlimited_agent_logins()`: the agent logins limited to no tenant, for
  `manage.py check --deploy` (ledger.W122).

The row-level security policies themselves are derived from `ledger.db_roles.TENANT_ROWS`
by `manage.py db_roles` (it runs after every migration), like the grants.
"""

from django.db import migrations

SQL = r"""
CREATE TABLE ledger_logintenant (
    login text NOT NULL,
    tenant varchar(100) NOT NULL,
    PRIMARY KEY (login, tenant)
);
ALTER TABLE ledger_logintenant ENABLE ROW LEVEL SECURITY;
CREATE POLICY ledger_own_login ON ledger_logintenant FOR SELECT
    USING (login = session_user::text OR login = current_user::text);

CREATE FUNCTION ledger_login_tenants() RETURNS text[]
LANGUAGE plpgsql STABLE PARALLEL SAFE AS $$
DECLARE
    tenants text[];
BEGIN
    SELECT CASE WHEN count(*) = 0 THEN NULL
                ELSE coalesce(array_agg(g.tenant ORDER BY g.tenant)
                                  FILTER (WHERE g.logins = g.limited), '{}') END
      INTO tenants
      FROM (SELECT t.tenant::text AS tenant, count(*) AS logins,
                   (SELECT count(DISTINCT u.login) FROM public.ledger_logintenant u
                     WHERE u.login IN (session_user::text, current_user::text)) AS limited
              FROM public.ledger_logintenant t
             WHERE t.login IN (session_user::text, current_user::text)
             GROUP BY t.tenant) g;
    RETURN tenants;
END
$$;

-- Whether this session sees the row `row_id` of a parent table (under the parent's own
-- policy): the policies of the rows that name a parent call these. A function, not a
-- subquery, so that planning a statement does not expand every parent's policy in turn
-- (planning ledger_operation's policy inline cost more than the statement itself).
CREATE FUNCTION ledger_operation_seen(row_id bigint) RETURNS boolean
LANGUAGE plpgsql STABLE PARALLEL SAFE AS $$
BEGIN
    RETURN EXISTS (SELECT 1 FROM public.ledger_operation o WHERE o.id = row_id);
END
$$;
CREATE FUNCTION ledger_run_seen(row_id bigint) RETURNS boolean
LANGUAGE plpgsql STABLE PARALLEL SAFE AS $$
BEGIN
    RETURN EXISTS (SELECT 1 FROM public.ledger_run r WHERE r.id = row_id);
END
$$;
CREATE FUNCTION ledger_step_seen(row_id bigint) RETURNS boolean
LANGUAGE plpgsql STABLE PARALLEL SAFE AS $$
BEGIN
    RETURN EXISTS (SELECT 1 FROM public.ledger_step s WHERE s.id = row_id);
END
$$;
CREATE FUNCTION ledger_fact_seen(row_id bigint) RETURNS boolean
LANGUAGE plpgsql STABLE PARALLEL SAFE AS $$
BEGIN
    RETURN EXISTS (SELECT 1 FROM public.ledger_fact f WHERE f.id = row_id);
END
$$;

CREATE FUNCTION ledger_lease_tenant_may(resource text, tenants text[]) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN CASE
    WHEN resource LIKE 'run:%' THEN
        replace(replace(split_part(resource, ':', 2), '%3A', ':'), '%25', '%') = ANY (tenants)
    WHEN resource LIKE 'reconcile:%' THEN false
    ELSE true
END;

CREATE FUNCTION ledger_lease_tenant_check() RETURNS trigger
LANGUAGE plpgsql SET search_path = public, pg_temp AS $$
DECLARE
    tenants text[] := ledger_login_tenants();
BEGIN
    IF tenants IS NOT NULL AND NOT ledger_lease_tenant_may(NEW.resource, tenants) THEN
        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',
            MESSAGE = format('lease %s: expected a lease of this login''s tenants (%s), found '
                             'another tenant''s or a worker''s, taken by login %s',
                             NEW.resource, array_to_string(tenants, ', '), session_user);
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER lease_tenant_check BEFORE INSERT OR UPDATE ON ledger_lease
    FOR EACH ROW EXECUTE FUNCTION ledger_lease_tenant_check();
ALTER TABLE ledger_lease ENABLE ALWAYS TRIGGER lease_tenant_check;

-- An event's tenant is its operation's: checked at commit, when an operation and its first
-- event written by one statement (receipts.record_intent) can see each other.
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

CREATE FUNCTION ledger_unlimited_agent_logins() RETURNS SETOF text
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
    SELECT r.rolname::text FROM pg_catalog.pg_roles r
     WHERE r.rolcanlogin AND NOT r.rolsuper
       AND EXISTS (SELECT FROM pg_catalog.pg_roles a WHERE a.rolname = 'ledger_agent'
                      AND pg_catalog.pg_has_role(r.oid, a.oid, 'MEMBER'))
       AND NOT EXISTS (SELECT FROM pg_catalog.pg_roles d WHERE d.rolname = 'ledger_desk'
                          AND pg_catalog.pg_has_role(r.oid, d.oid, 'MEMBER'))
       AND NOT EXISTS (SELECT FROM public.ledger_logintenant t WHERE t.login = r.rolname)
     ORDER BY 1
$$;
REVOKE ALL ON FUNCTION ledger_unlimited_agent_logins() FROM PUBLIC;
"""

REVERSE = r"""
DO $$
DECLARE
    secured record;
BEGIN
    FOR secured IN SELECT tablename FROM pg_policies
                    WHERE schemaname = 'public' AND policyname = 'ledger_tenant_rows' LOOP
        EXECUTE format('DROP POLICY ledger_tenant_rows ON %I', secured.tablename);
        EXECUTE format('ALTER TABLE %I DISABLE ROW LEVEL SECURITY', secured.tablename);
    END LOOP;
END
$$;
DROP FUNCTION IF EXISTS ledger_unlimited_agent_logins();
DROP TRIGGER IF EXISTS event_tenant_check ON ledger_operationevent;
DROP FUNCTION IF EXISTS ledger_event_tenant_check();
DROP TRIGGER IF EXISTS lease_tenant_check ON ledger_lease;
DROP FUNCTION IF EXISTS ledger_lease_tenant_check();
DROP FUNCTION IF EXISTS ledger_lease_tenant_may(text, text[]);
DROP FUNCTION IF EXISTS ledger_operation_seen(bigint);
DROP FUNCTION IF EXISTS ledger_run_seen(bigint);
DROP FUNCTION IF EXISTS ledger_step_seen(bigint);
DROP FUNCTION IF EXISTS ledger_fact_seen(bigint);
DROP FUNCTION IF EXISTS ledger_login_tenants();
DROP TABLE IF EXISTS ledger_logintenant;
"""


class Migration(migrations.Migration):

    dependencies = [
        ('ledger', '0047_positive_controls'),
    ]

    operations = [
        migrations.RunSQL(SQL, REVERSE),
    ]
