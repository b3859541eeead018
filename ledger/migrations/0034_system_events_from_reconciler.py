"""A `system` actor's event (the sweep of stale submissions: submitted -> outcome_unknown
for a sender that is gone) only from a session in role ledger_reconciler, the background
work's role that runs the sweep (`reconcile.sweep_stale_submissions` in the reconcile
loop): an agent cannot declare another agent's submission lost. Agents' own events still
skip the trigger by its WHEN clause."""

from django.db import migrations

FUNCTION = r"""
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
    ELSIF NEW.actor_kind = 'system' AND NOT ledger_session_is('ledger_reconciler') THEN
        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',
            MESSAGE = format('operation event %s -> %s: expected a system event (the sweep '
                             'of stale submissions) to come from a session in role '
                             'ledger_reconciler, found it from role %s', NEW.from_state,
                             NEW.to_state, current_user);
    END IF;
    RETURN NEW;
END
$$;
"""

TRIGGER = r"""
DROP TRIGGER IF EXISTS ledger_event_actor_check ON ledger_operationevent;
CREATE TRIGGER ledger_event_actor_check BEFORE INSERT ON ledger_operationevent
    FOR EACH ROW
    WHEN (NEW.actor_kind IN ('human', 'reconciler'{system}) OR NEW.from_state = 'reconciling'
          OR NEW.to_state = 'reconciling')
    EXECUTE FUNCTION ledger_event_actor_check();
"""


class Migration(migrations.Migration):
    dependencies = [
        ("ledger", "0033_operation_relies_on"),
    ]

    # Backwards: the trigger fires for system events no more (the function's new branch
    # is then never reached).
    operations = [migrations.RunSQL(FUNCTION + TRIGGER.format(system=", 'system'"),
                                    TRIGGER.format(system=""))]
