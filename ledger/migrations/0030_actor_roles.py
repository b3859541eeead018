"""PostgreSQL decides who may act as a person, and as a reconciler, from the session's role.

`manage.py db_roles` (ledger/db_roles.py) creates three NOLOGIN group roles, ledger_agent,
ledger_reconciler and ledger_desk, and their grants. These triggers refuse, whatever the
grants:

- a person's event (actor kind human: a decision, a denial, an intent edit, an
  acknowledgement), an approval or denial, a two-person proposal and a fact-conflict
  decision unless the session's role (`current_user`, never a setting) is a member of
  ledger_desk; and unless the user it names (`decided_by`, `proposed_by`, `user`) holds the
  permission and the tenant grant at that moment, read from Django's auth tables and the
  tenant grants;
- a reconciler's event (actor kind reconciler), and any move into or out of reconciling
  (a claim, a verdict, a release), unless the session's role is a member of
  ledger_reconciler.

A superuser passes every role check (it could switch the triggers off anyway); a role that
does not exist yet (db_roles not run) has no members. The user check reads tables the
desk's role may read but the agent's may not, so `ledger_person_may` is SECURITY DEFINER
(owned by the tables' owner, EXECUTE for ledger_desk only, granted by db_roles); the
trigger functions themselves run as the caller, so that `current_user` is the session's.
Agents' own events skip the triggers by their WHEN clause: the agent's write path pays
nothing.
"""

from django.db import migrations

SQL = r"""
-- Whether the session's role (current_user) is a member of `group_role`: FALSE when that
-- role does not exist; TRUE for a superuser.
CREATE OR REPLACE FUNCTION ledger_session_is(group_role name) RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT EXISTS (SELECT FROM pg_roles WHERE rolname = current_user AND rolsuper)
        OR EXISTS (SELECT FROM pg_roles r WHERE r.rolname = group_role
                     AND pg_has_role(current_user, r.oid, 'MEMBER'))
$$;

-- NULL when user `user_id` is active and holds ledger permission `codename` (directly or
-- through a group; a superuser holds all) and is granted `tenant_name` (a superuser sees
-- every tenant); otherwise what it lacks, for the caller's message.
CREATE OR REPLACE FUNCTION ledger_person_may(user_id bigint, codename text, tenant_name text)
RETURNS text LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    person record;
BEGIN
    IF user_id IS NULL THEN
        RETURN 'no deciding user';
    END IF;
    SELECT u.id, u.username, u.is_active, u.is_superuser INTO person
      FROM auth_user u WHERE u.id = user_id;
    IF NOT FOUND THEN
        RETURN format('user %s, who does not exist', user_id);
    END IF;
    IF NOT person.is_active THEN
        RETURN format('user %s, who is inactive', person.username);
    END IF;
    IF person.is_superuser THEN
        RETURN NULL;
    END IF;
    IF NOT EXISTS (
        SELECT FROM auth_permission p
          JOIN django_content_type ct ON ct.id = p.content_type_id AND ct.app_label = 'ledger'
         WHERE p.codename = ledger_person_may.codename
           AND (EXISTS (SELECT FROM auth_user_user_permissions up
                         WHERE up.user_id = person.id AND up.permission_id = p.id)
                OR EXISTS (SELECT FROM auth_user_groups ug
                             JOIN auth_group_permissions gp ON gp.group_id = ug.group_id
                            WHERE ug.user_id = person.id AND gp.permission_id = p.id))) THEN
        RETURN format('user %s without permission ledger.%s', person.username, codename);
    END IF;
    IF NOT EXISTS (SELECT FROM ledger_tenantaccess a
                    WHERE a.user_id = person.id AND a.tenant = tenant_name) THEN
        RETURN format('user %s without a grant of tenant %s', person.username, tenant_name);
    END IF;
    RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION ledger_person_may(bigint, text, text) FROM PUBLIC;

CREATE OR REPLACE FUNCTION ledger_event_actor_check() RETURNS trigger
LANGUAGE plpgsql SET search_path = public, pg_temp AS $$
DECLARE
    lacking text;
BEGIN
    IF NEW.actor_kind = 'human' THEN
        IF NOT ledger_session_is('ledger_desk') THEN
            RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',
                MESSAGE = format('operation event %s -> %s: expected a person''s decision to '
                                 'come from the desk (a session in role ledger_desk), found '
                                 'it from role %s', NEW.from_state, NEW.to_state, current_user);
        END IF;
        lacking := ledger_person_may(NEW.decided_by_id, 'resolve_operation', NEW.tenant);
        IF lacking IS NOT NULL THEN
            RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',
                MESSAGE = format('operation event %s -> %s: expected the deciding user to '
                                 'hold ledger.resolve_operation and a grant of tenant %s, '
                                 'found %s', NEW.from_state, NEW.to_state, NEW.tenant, lacking);
        END IF;
    ELSIF (NEW.actor_kind = 'reconciler' OR NEW.from_state = 'reconciling'
           OR NEW.to_state = 'reconciling') AND NOT ledger_session_is('ledger_reconciler') THEN
        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',
            MESSAGE = format('operation event %s -> %s: expected a reconciler''s claim or '
                             'verdict to come from a session in role ledger_reconciler, '
                             'found actor kind %s from role %s', NEW.from_state,
                             NEW.to_state, NEW.actor_kind, current_user);
    END IF;
    RETURN NEW;
END
$$;

DROP TRIGGER IF EXISTS ledger_event_actor_check ON ledger_operationevent;
CREATE TRIGGER ledger_event_actor_check BEFORE INSERT ON ledger_operationevent
    FOR EACH ROW
    WHEN (NEW.actor_kind IN ('human', 'reconciler') OR NEW.from_state = 'reconciling'
          OR NEW.to_state = 'reconciling')
    EXECUTE FUNCTION ledger_event_actor_check();

-- A person's row (TG_ARGV[0]: the column naming the user; TG_ARGV[1]: the permission).
CREATE OR REPLACE FUNCTION ledger_person_row_check() RETURNS trigger
LANGUAGE plpgsql SET search_path = public, pg_temp AS $$
DECLARE
    lacking text;
BEGIN
    IF NOT ledger_session_is('ledger_desk') THEN
        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',
            MESSAGE = format('%s: expected a person''s decision to come from the desk (a '
                             'session in role ledger_desk), found it from role %s',
                             TG_TABLE_NAME, current_user);
    END IF;
    lacking := ledger_person_may((to_jsonb(NEW) ->> TG_ARGV[0])::bigint, TG_ARGV[1],
                                 NEW.tenant);
    IF lacking IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',
            MESSAGE = format('%s: expected the deciding user to hold ledger.%s and a grant '
                             'of tenant %s, found %s', TG_TABLE_NAME, TG_ARGV[1], NEW.tenant,
                             lacking);
    END IF;
    RETURN NEW;
END
$$;

DROP TRIGGER IF EXISTS ledger_approval_person_check ON ledger_approval;
CREATE TRIGGER ledger_approval_person_check BEFORE INSERT ON ledger_approval
    FOR EACH ROW EXECUTE FUNCTION ledger_person_row_check('decided_by_id', 'resolve_operation');
DROP TRIGGER IF EXISTS ledger_proposal_person_check ON ledger_resolutionproposal;
CREATE TRIGGER ledger_proposal_person_check BEFORE INSERT ON ledger_resolutionproposal
    FOR EACH ROW EXECUTE FUNCTION ledger_person_row_check('proposed_by_id', 'resolve_operation');
DROP TRIGGER IF EXISTS ledger_fact_decision_person_check ON ledger_factdecision;
CREATE TRIGGER ledger_fact_decision_person_check BEFORE INSERT ON ledger_factdecision
    FOR EACH ROW EXECUTE FUNCTION ledger_person_row_check('user_id', 'resolve_factconflict');
"""

REVERSE = r"""
DROP TRIGGER IF EXISTS ledger_fact_decision_person_check ON ledger_factdecision;
DROP TRIGGER IF EXISTS ledger_proposal_person_check ON ledger_resolutionproposal;
DROP TRIGGER IF EXISTS ledger_approval_person_check ON ledger_approval;
DROP TRIGGER IF EXISTS ledger_event_actor_check ON ledger_operationevent;
DROP FUNCTION IF EXISTS ledger_person_row_check();
DROP FUNCTION IF EXISTS ledger_event_actor_check();
DROP FUNCTION IF EXISTS ledger_person_may(bigint, text, text);
DROP FUNCTION IF EXISTS ledger_session_is(name);
"""


class Migration(migrations.Migration):
    dependencies = [
        ("ledger", "0029_operation_references_restrict"),
    ]

    operations = [migrations.RunSQL(SQL, REVERSE)]
