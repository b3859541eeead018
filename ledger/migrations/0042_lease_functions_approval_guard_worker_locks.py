"""Leases, approval requests and the workers' locks take no writer's word (issue 41, items 3,
4 and 9).

- Leases change only through three SECURITY DEFINER functions, owned by the tables' owner
  (EXECUTE for ledger_agent and ledger_reconciler, granted by db_roles): acquire (a token
  larger than any before; a live lease of another holder is refused), renew and release
  (only by the holder of the current token). Times are the database's clock. The trigger
  `lease_change_check` refuses any other role's write, and anyone's token rewind or
  take-over of a live lease; `lease_never_deleted` keeps every row.
- Approval requests: `approval_request_check` (ledger.models.approval_gate).
- The workers' locks: `ledger_worker_lock(name)` locks a row of ledger_workerlock FOR
  UPDATE to the end of the transaction, or says it is taken (SKIP LOCKED); only the
  reconciler's role may call it, and no application role may lock the rows itself.
"""


import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations, models

import ledger.models.triggers

FUNCTIONS = r"""
CREATE OR REPLACE FUNCTION ledger_lease_checked(lease_resource text, lease_owner text,
                                                ttl interval) RETURNS void
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF COALESCE(lease_resource, '') = '' OR COALESCE(lease_owner, '') = '' THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('expected a lease''s resource and owner, found %L and %L',
                             lease_resource, lease_owner);
    END IF;
    IF ttl IS NULL OR ttl <= interval '0' THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('lease %s: expected a positive ttl, found %s', lease_resource,
                             COALESCE(ttl::text, 'none'));
    END IF;
END
$$;

-- The lease on `lease_resource` for `lease_owner` until ttl from now: acquired, with a token
-- larger than any the resource had, when it is free, expired or already the owner's;
-- otherwise not acquired, with the current holder, token and expiry.
CREATE OR REPLACE FUNCTION ledger_lease_acquire(lease_resource text, lease_owner text,
                                                ttl interval)
RETURNS TABLE (acquired boolean, lease_token bigint, lease_holder varchar,
               lease_expires_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    PERFORM ledger_lease_checked(lease_resource, lease_owner, ttl);
    INSERT INTO ledger_lease AS l (resource, owner, token, acquired_at, expires_at)
    VALUES (lease_resource, lease_owner, 1, clock_timestamp(), clock_timestamp() + ttl)
    ON CONFLICT (resource) DO UPDATE
       SET owner = EXCLUDED.owner, token = l.token + 1, acquired_at = clock_timestamp(),
           expires_at = EXCLUDED.expires_at
     WHERE l.expires_at <= clock_timestamp() OR l.owner = EXCLUDED.owner
    RETURNING l.token, l.owner, l.expires_at INTO lease_token, lease_holder, lease_expires_at;
    acquired := FOUND;
    IF NOT acquired THEN
        SELECT l.token, l.owner, l.expires_at INTO lease_token, lease_holder, lease_expires_at
          FROM ledger_lease l WHERE l.resource = lease_resource;
    END IF;
    RETURN NEXT;
END
$$;

-- The holder of the current token extends its lease to ttl from now: the new expiry, or
-- NULL when `lease_token` is not the current token of `lease_owner`.
CREATE OR REPLACE FUNCTION ledger_lease_renew(lease_resource text, lease_owner text,
                                              lease_token bigint, ttl interval)
RETURNS timestamptz
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    renewed timestamptz;
BEGIN
    PERFORM ledger_lease_checked(lease_resource, lease_owner, ttl);
    UPDATE ledger_lease l SET expires_at = clock_timestamp() + ttl
     WHERE l.resource = lease_resource AND l.owner = lease_owner AND l.token = lease_token
    RETURNING l.expires_at INTO renewed;
    RETURN renewed;
END
$$;

-- The holder of the current token ends its lease now (the row stays: the next token is
-- still larger); FALSE when `lease_token` is not the current token of `lease_owner`.
CREATE OR REPLACE FUNCTION ledger_lease_release(lease_resource text, lease_owner text,
                                                lease_token bigint)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    UPDATE ledger_lease l SET expires_at = clock_timestamp()
     WHERE l.resource = lease_resource AND l.owner = lease_owner AND l.token = lease_token;
    RETURN FOUND;
END
$$;

-- A background worker's lock `lock_name` (`seal:<tenant>`, `notify:<channel id>`), held to
-- the end of the caller's transaction: TRUE when taken, FALSE when another worker holds it
-- (never waits for it).
CREATE OR REPLACE FUNCTION ledger_worker_lock(lock_name text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    INSERT INTO ledger_workerlock (name) VALUES (lock_name) ON CONFLICT (name) DO NOTHING;
    PERFORM 1 FROM ledger_workerlock w WHERE w.name = lock_name FOR UPDATE SKIP LOCKED;
    RETURN FOUND;
END
$$;

REVOKE ALL ON FUNCTION ledger_lease_checked(text, text, interval) FROM PUBLIC;
REVOKE ALL ON FUNCTION ledger_lease_acquire(text, text, interval) FROM PUBLIC;
REVOKE ALL ON FUNCTION ledger_lease_renew(text, text, bigint, interval) FROM PUBLIC;
REVOKE ALL ON FUNCTION ledger_lease_release(text, text, bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION ledger_worker_lock(text) FROM PUBLIC;
"""

DROP_FUNCTIONS = """
DROP FUNCTION IF EXISTS ledger_worker_lock(text);
DROP FUNCTION IF EXISTS ledger_lease_release(text, text, bigint);
DROP FUNCTION IF EXISTS ledger_lease_renew(text, text, bigint, interval);
DROP FUNCTION IF EXISTS ledger_lease_acquire(text, text, interval);
DROP FUNCTION IF EXISTS ledger_lease_checked(text, text, interval);
"""


class Migration(migrations.Migration):

    dependencies = [
        ('ledger', '0041_actor_kind_closed_fence_by_run'),
    ]

    operations = [
        migrations.CreateModel(
            name='WorkerLock',
            fields=[
                ('name', models.CharField(max_length=200, primary_key=True, serialize=False)),
            ],
            options={
                'ordering': ['name'],
            },
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='approvalrequest',
            trigger=pgtrigger.compiler.Trigger(name='approval_request_check', sql=ledger.models.triggers.UnbypassableTriggerSql(declare='DECLARE op record; needed integer; have integer;', func="\n    SELECT o.operation_id, o.tenant, o.operation, o.state, o.intent_fingerprint INTO op\n      FROM ledger_operation o WHERE o.id = NEW.operation_id;\n    IF NOT FOUND THEN\n        RAISE EXCEPTION USING ERRCODE = 'foreign_key_violation',\n            MESSAGE = format('approval request: expected an existing operation, found id %s',\n                             NEW.operation_id);\n    END IF;\n    IF NEW.tenant IS DISTINCT FROM op.tenant THEN\n        RAISE EXCEPTION USING ERRCODE = 'check_violation',\n            MESSAGE = format('approval request of operation %s: expected its operation''s '\n                             'tenant %s, found %s', op.operation_id, op.tenant, NEW.tenant);\n    END IF;\n    IF TG_OP = 'UPDATE' AND NEW.operation_id IS DISTINCT FROM OLD.operation_id THEN\n        RAISE EXCEPTION USING ERRCODE = 'check_violation',\n            MESSAGE = format('approval request of operation %s: expected its operation '\n                             'unchanged, found an UPDATE moving it', op.operation_id);\n    END IF;\n    IF TG_OP = 'INSERT' AND NEW.status IS DISTINCT FROM 'pending' THEN\n        RAISE EXCEPTION USING ERRCODE = 'check_violation',\n            MESSAGE = format('approval request of operation %s: expected a new request '\n                             'pending (people decide it), found %s', op.operation_id,\n                             NEW.status);\n    END IF;\n    needed := GREATEST(1, \n    (SELECT COALESCE(MAX(CASE WHEN p.consequential THEN GREATEST(p.approvals_needed, 2)\n                              ELSE p.approvals_needed END), 0)\n       FROM ledger_approvalpolicy p\n      WHERE p.tenant = op.tenant AND p.requires_approval\n        AND op.operation LIKE replace(replace(replace(p.pattern, '_', '\\_'), '*', '%'), '?', '_'))\n    );\n    IF NEW.status = 'pending' THEN\n        IF op.state IS DISTINCT FROM 'planned' OR NEW.decided_at IS NOT NULL THEN\n            RAISE EXCEPTION USING ERRCODE = 'check_violation',\n                MESSAGE = format('approval request of operation %s: expected a pending '\n                                 'request of a planned operation, undecided, found the '\n                                 'operation %s, decided at %s', op.operation_id, op.state,\n                                 COALESCE(NEW.decided_at::text, 'never'));\n        END IF;\n        IF NEW.approvals_needed < needed THEN\n            RAISE EXCEPTION USING ERRCODE = 'check_violation',\n                MESSAGE = format('approval request of operation %s: expected at least %s '\n                                 'approval(s) asked (the policies of tenant %s, at least one '\n                                 'person), found %s', op.operation_id, needed, op.tenant,\n                                 NEW.approvals_needed);\n        END IF;\n        RETURN NEW;\n    END IF;\n    IF NEW.approvals_needed IS DISTINCT FROM OLD.approvals_needed THEN\n        RAISE EXCEPTION USING ERRCODE = 'check_violation',\n            MESSAGE = format('approval request of operation %s: expected the people asked to '\n                             'change only when the agent asks again (pending), found %s -> %s '\n                             'on a %s request', op.operation_id, OLD.approvals_needed,\n                             NEW.approvals_needed, NEW.status);\n    END IF;\n    IF NEW.status IS NOT DISTINCT FROM OLD.status\n       AND NEW.decided_at IS NOT DISTINCT FROM OLD.decided_at THEN\n        RETURN NEW;\n    END IF;\n    IF NOT ledger_session_is('ledger_desk') THEN\n        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',\n            MESSAGE = format('approval request of operation %s: expected a request approved '\n                             'or denied by the desk (a session in role ledger_desk), found '\n                             'status %s from role %s', op.operation_id, NEW.status,\n                             current_user);\n    END IF;\n    IF NEW.status = 'approved' THEN\n        SELECT COUNT(DISTINCT a.decided_by_id) INTO have FROM ledger_approval a\n         WHERE a.operation_id = NEW.operation_id\n           AND a.intent_fingerprint = op.intent_fingerprint AND a.decision = 'approve'\n           AND a.created_at <= NEW.decided_at AND a.expires_at > NEW.decided_at;\n        needed := GREATEST(needed, NEW.approvals_needed);\n        IF NEW.decided_at IS NULL OR have < needed THEN\n            RAISE EXCEPTION USING ERRCODE = 'check_violation',\n                MESSAGE = format('approval request of operation %s: expected %s live '\n                                 'approval(s) of fingerprint %s at its decision (%s) to mark '\n                                 'it approved, found %s', op.operation_id, needed,\n                                 op.intent_fingerprint,\n                                 COALESCE(NEW.decided_at::text, 'no time'), have);\n        END IF;\n    ELSIF NEW.status = 'denied' THEN\n        IF NEW.decided_at IS NULL OR NOT EXISTS (\n                SELECT 1 FROM ledger_approval a\n                 WHERE a.operation_id = NEW.operation_id AND a.decision = 'deny') THEN\n            RAISE EXCEPTION USING ERRCODE = 'check_violation',\n                MESSAGE = format('approval request of operation %s: expected a person''s '\n                                 'denial recorded, with its time, to mark it denied, found '\n                                 'none (decided at %s)', op.operation_id,\n                                 COALESCE(NEW.decided_at::text, 'no time'));\n        END IF;\n    ELSE\n        RAISE EXCEPTION USING ERRCODE = 'check_violation',\n            MESSAGE = format('approval request of operation %s: expected status pending, '\n                             'approved or denied, found %s', op.operation_id, NEW.status);\n    END IF;\n    RETURN NEW;\n    ", hash='8b2c5bd44c68c3b3db5c71a54ef2784b8732acdc', operation='INSERT OR UPDATE', pgid='pgtrigger_approval_request_check_76619', table='ledger_approvalrequest', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='lease',
            trigger=pgtrigger.compiler.Trigger(name='lease_change_check', sql=ledger.models.triggers.UnbypassableTriggerSql(func="\n    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_class c\n                  WHERE c.oid = TG_RELID\n                    AND pg_catalog.pg_has_role(current_user, c.relowner, 'MEMBER')) THEN\n        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',\n            MESSAGE = format('lease %s: expected a lease taken, renewed or released only '\n                             'through ledger_lease_acquire, ledger_lease_renew or '\n                             'ledger_lease_release (ledger.leases), found a direct %s from '\n                             'role %s', NEW.resource, TG_OP, current_user);\n    END IF;\n    IF TG_OP = 'UPDATE' THEN\n        IF NEW.resource IS DISTINCT FROM OLD.resource THEN\n            RAISE EXCEPTION USING ERRCODE = 'check_violation',\n                MESSAGE = format('lease %s: expected its resource unchanged, found %s',\n                                 OLD.resource, NEW.resource);\n        END IF;\n        IF NEW.token < OLD.token THEN\n            RAISE EXCEPTION USING ERRCODE = 'check_violation',\n                MESSAGE = format('lease %s: expected its fencing token never to decrease, '\n                                 'found %s -> %s', OLD.resource, OLD.token, NEW.token);\n        END IF;\n        IF NEW.owner IS DISTINCT FROM OLD.owner\n           AND (OLD.expires_at > clock_timestamp() OR NEW.token <= OLD.token) THEN\n            RAISE EXCEPTION USING ERRCODE = 'check_violation',\n                MESSAGE = format('lease %s: expected a new holder only once the lease expired '\n                                 'and with a larger token, found %s (token %s, live until %s) '\n                                 'replaced by %s (token %s)', OLD.resource, OLD.owner,\n                                 OLD.token, OLD.expires_at, NEW.owner, NEW.token);\n        END IF;\n    END IF;\n    RETURN NEW;\n", hash='1c18af372fbdec3c04b0dfbc3e47ae9fdc98f1e3', operation='INSERT OR UPDATE', pgid='pgtrigger_lease_change_check_34f7c', table='ledger_lease', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='lease',
            trigger=pgtrigger.compiler.Trigger(name='lease_never_deleted', sql=ledger.models.triggers.UnbypassableTriggerSql(func="\n    RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',\n        MESSAGE = format('lease %s: expected a lease row to stay (the next token grows from '\n                         'it), found a DELETE from role %s', OLD.resource, current_user);\n", hash='9f776e634e5f1612e566f99eb4f18505b0f660f7', operation='DELETE', pgid='pgtrigger_lease_never_deleted_82742', table='ledger_lease', when='BEFORE')),
        ),
        migrations.RunSQL(FUNCTIONS, DROP_FUNCTIONS),
    ]
