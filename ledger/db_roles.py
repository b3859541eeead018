"""PostgreSQL roles per kind of actor: `manage.py db_roles` (supersedes `manage.py app_role`).

Three NOLOGIN group roles, each with the least grants its code paths need:

    ledger_agent       agents: in-process Python agents, the HTTP API and MCP paths
    ledger_reconciler  reconcile workers: claims, verdicts, evidence, sweeps, re-reads, the
                       sealer, the purge, the notification loop
    ledger_desk        the review desk: people's decisions, approvals, policies, channels,
                       tenant grants, agent keys; Django's auth tables and sessions

`apply()` runs as the tables' owner after `migrate`, and again after every later migration
(it refuses a migration state behind the code, naming the missing migration). Each run
takes every right the three roles hold on the schema away first, then grants what
`LEDGER_WRITES` says: whatever an older version granted is gone. A ledger table missing
from `LEDGER_WRITES` stops it: decide who writes it when you add it.

Login roles are made with `ensure_login(name, kinds)` (`manage.py db_roles --login
name=agent,desk`): a login IN ROLE the group roles of its kinds, no superuser, no member of
the owner. Role creation is cluster-wide and idempotent: two runs at once on one server
(two test databases) both succeed.

What PostgreSQL then decides from the session's role (migration 0030): a person's decision
only from ledger_desk, for a user holding the permission and the tenant grant; a
reconciler's claim and verdict only from ledger_reconciler.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable

from django.db import DatabaseError, ProgrammingError, connection, transaction
from psycopg.pq import TransactionStatus

from ledger import errors
from ledger.inputs import check_identifier

AGENT, RECONCILER, DESK = "agent", "reconciler", "desk"
KINDS = (AGENT, RECONCILER, DESK)
ROLE = {AGENT: "ledger_agent", RECONCILER: "ledger_reconciler", DESK: "ledger_desk"}

# Columns of an operation its transitions set (ledger.transitions); `intent` and its
# fingerprint change only with a person's approval of an edited intent (the desk).
_OPERATION_MOVES = (
    "state, version, state_changed_at, conflict, attempt, external_id, error_code, "
    "error_detail, submitted_at, in_flight_until, completed_at, unknown_since, "
    "next_attempt_at, reconcile_attempts, reconcile_failures, result, result_unstorable, "
    "reread_due_at"
)

# table => {kind: its writes, as GRANT takes them}. Every kind reads every ledger table;
# a kind missing from a table's entry writes nothing to it.
LEDGER_WRITES: dict[str, dict[str, str]] = {
    "ledger_operation": {
        AGENT: f"INSERT, UPDATE ({_OPERATION_MOVES})",
        RECONCILER: f"UPDATE ({_OPERATION_MOVES})",
        DESK: f"UPDATE ({_OPERATION_MOVES}, intent, intent_fingerprint)",
    },
    # append-only: the audit trail (who may write which event: migration 0030's trigger)
    "ledger_operationevent": {AGENT: "INSERT", RECONCILER: "INSERT", DESK: "INSERT"},
    "ledger_evidence": {RECONCILER: "INSERT"},
    "ledger_factdecision": {DESK: "INSERT"},
    "ledger_episode": {AGENT: "INSERT"},
    "ledger_retentionchange": {DESK: "INSERT"},
    "ledger_tenantaccesschange": {DESK: "INSERT"},
    "ledger_agentkeychange": {DESK: "INSERT"},
    "ledger_auditverification": {RECONCILER: "INSERT", DESK: "INSERT"},
    "ledger_approval": {DESK: "INSERT"},
    "ledger_resolutionproposal": {DESK: "INSERT"},
    "ledger_approvalpolicychange": {DESK: "INSERT"},
    "ledger_unknownoutcomepolicychange": {DESK: "INSERT"},
    "ledger_operationnote": {DESK: "INSERT"},
    "ledger_notificationchannelchange": {DESK: "INSERT"},
    "ledger_deliveryattempt": {RECONCILER: "INSERT"},
    # coverage readings (manage.py coverage, run as the reconciler): append-only
    "ledger_coveragereading": {RECONCILER: "INSERT"},
    # written only by ledger_retention_purge / ledger_retention_redact
    "ledger_chainanchor": {},
    "ledger_redaction": {},
    # signed chain heads: written by manage.py audit_export, which holds the signing key and
    # runs as the tables' owner (ledger.audit_bundle)
    "ledger_auditcheckpoint": {},
    # the chains' heads move in the sealer's ledger_seal_events and ledger_seal_links alone
    "ledger_chainhead": {},
    # the records chain: written by PostgreSQL's trigger ledger_record_link alone
    "ledger_recordlink": {},
    # retention: policies are the desk's; the purge (a background worker) writes its runs
    "ledger_retentionpolicy": {DESK: "INSERT, UPDATE, DELETE"},
    # execution state's policies likewise; their rows (facts, episodes, obligations) are
    # deleted only by ledger_retention_purge_state, which no role's grant replaces
    "ledger_stateretentionpolicy": {DESK: "INSERT, UPDATE, DELETE"},
    "ledger_purgerun": {
        RECONCILER: "INSERT, UPDATE (operations_purged, events_purged, evidence_purged, "
                    "operations_redacted, evidence_redacted, first_operation_id, "
                    "last_operation_id, finished_at, policy_id, state_policy_id, rows_purged)",
        # deleting a policy empties it in its runs
        DESK: "UPDATE (policy_id, state_policy_id)",
    },
    # approvals: an agent asks; people decide (policies, the request's status)
    "ledger_approvalpolicy": {DESK: "INSERT, UPDATE"},
    # unknown-outcome policies: the desk's (admins); the reconciler reads them
    "ledger_unknownoutcomepolicy": {
        DESK: "INSERT, UPDATE (automatic_retry, attempts, not_yet_window, updated_by_id, "
              "updated_at)"},
    # (the trigger approval_request_check: an agent's request is pending, of its
    # operation's tenant, asking at least what the policies ask; only the desk marks it
    # approved, with enough live approvals, or denied, with a person's denial)
    "ledger_approvalrequest": {
        AGENT: "INSERT, UPDATE (tenant, note, requested_by, approvals_needed, status, "
               "requested_at, decided_at)",
        DESK: "UPDATE (status, decided_at)",
    },
    # notifications: channels are the desk's; the notification loop writes the rest
    "ledger_notificationchannel": {DESK: "INSERT, UPDATE (is_active, updated_by_id, updated_at)"},
    "ledger_notificationbatch": {
        RECONCILER: "INSERT, UPDATE (counts, item_count, payload, status, attempts, "
                    "next_attempt_at, last_error, delivered_at)",
    },
    "ledger_notificationsent": {RECONCILER: "INSERT"},
    # the desk's search: written only by PostgreSQL's triggers on operations (migration
    # 0051), at insert and when the external id is set; every kind reads it
    "ledger_operationsearch": {},
    # the desk: a reviewer's claim is taken over in place when expired, and released
    "ledger_claim": {
        DESK: "INSERT, UPDATE (claimed_by_id, claimed_by_name, claimed_at, expires_at), DELETE",
    },
    # the desk: a person's saved queue filters, replaced or deleted by their owner
    "ledger_savedview": {DESK: "INSERT, UPDATE (owner_name, filters, updated_at), DELETE"},
    # execution state: their triggers allow each row's one-way moves only
    "ledger_fact": {
        AGENT: "INSERT, UPDATE (status, superseded_by_id)",
        DESK: "INSERT, UPDATE (status, superseded_by_id)",
    },
    "ledger_factconflict": {
        AGENT: "INSERT",
        DESK: "UPDATE (state, resolved_at, resolved_by_id, resolution_reason, chosen_id, "
              "resolved_fact_id)",
    },
    "ledger_obligation": {
        AGENT: "INSERT, UPDATE (state, result, committed_at, cancelled_at, cancel_reason, "
               "fencing_token)",
    },
    "ledger_run": {AGENT: "INSERT"},
    "ledger_step": {AGENT: "INSERT, UPDATE (state, started_at, committed_at, started_token, "
                           "committed_token)"},
    "ledger_step_depends_on": {AGENT: "INSERT"},
    # leases change only through ledger_lease_acquire / _renew / _release (FUNCTIONS). The
    # one column's UPDATE is there because the fences share-lock the lease row (FOR SHARE
    # needs UPDATE on a column): the trigger lease_change_check refuses every UPDATE that
    # is not the functions'.
    "ledger_lease": {AGENT: "UPDATE (acquired_at)", RECONCILER: "UPDATE (acquired_at)"},
    # the workers' locks: taken only through ledger_worker_lock (FUNCTIONS); no role may
    # write or lock a row itself, so no agent's or person's login holds a worker's lock
    "ledger_workerlock": {},
    # people and keys: the desk's
    "ledger_tenantaccess": {DESK: "INSERT, DELETE"},
    # the tenants of a tenant-limited login: the owner's (ensure_login) alone
    "ledger_logintenant": {},
    "ledger_agentkey": {DESK: "INSERT, UPDATE (revoked_at, revoked_by_name)"},
}

# Tenant-limited logins (`ensure_login(..., tenants=...)`, migration 0048): table => which
# of its rows such a login may read and write, a condition on the row with `{tenants}` for
# the login's tenants (a text[]) and `{row}` for the table (a subquery's columns would
# otherwise capture the row's own of the same name). `_grant_all` makes one row-level
# security policy per table from it and the limited logins' tenants (`tenant_policy`), for
# every role, so a worker, the desk, an agent login without tenants and
# the web login pass as before; the owner and the SECURITY DEFINER functions are not
# subject to it. A ledger table missing here stops db_roles, like one missing from
# LEDGER_WRITES. FALSE: no row is any tenant's, so a limited login sees none.
_OWN = "{row}.tenant = ANY ({tenants})"


def _of(parent: str, column: str, *, optional: bool = False) -> str:
    """The row's `column` names a row of `parent` this session sees (`ledger_<parent>_seen`,
    migration 0048: the parent's own policy decides): a tenant the writer puts on the row
    is not taken for its parent's."""
    seen = f"ledger_{parent}_seen({{row}}.{column})"
    return f"({{row}}.{column} IS NULL OR {seen})" if optional else seen


_OF_OPERATION = _of("operation", "operation_id")
_OWN_OF_OPERATION = f"{_OWN} AND {_OF_OPERATION}"
_OWN_OF_RUN = f"{_OWN} AND {_of('run', 'run_id')}"
TENANT_ROWS: dict[str, str] = {
    "ledger_operation": f"{_OWN} AND {_of('run', 'run_id', optional=True)} "
                        f"AND {_of('step', 'step_id', optional=True)}",
    # (its operation's tenant: the trigger event_chain_columns, which reads the operation's
    # row for the event's content, since record_intent writes an operation and its first
    # event in one statement, whose parts a policy cannot see together)
    "ledger_operationevent": _OWN,
    "ledger_evidence": _OF_OPERATION,
    "ledger_operationsearch": _OWN,
    "ledger_coveragereading": _OWN,
    # (a fact's links to other facts, superseded_by and contradicts, are not checked here, as
    # a policy cannot read its own table: the trigger fact_insert_check holds them)
    "ledger_fact": f"{_OWN} AND {_of('run', 'run_id', optional=True)}",
    "ledger_factdecision": _OWN,
    "ledger_factconflict": f"{_OWN} AND {_of('fact', 'current_id')} "
                           f"AND {_of('fact', 'candidate_id')}",
    "ledger_obligation": _OWN_OF_RUN,
    "ledger_run": _OWN,
    "ledger_step": _of("run", "run_id"),
    "ledger_step_depends_on": f"{_of('step', 'from_step_id')} AND {_of('step', 'to_step_id')}",
    "ledger_episode": _OWN_OF_RUN,
    "ledger_lease": "ledger_lease_tenant_may(resource, {tenants})",
    "ledger_approvalrequest": _OWN_OF_OPERATION,
    "ledger_approval": _OWN_OF_OPERATION,
    "ledger_approvalpolicy": _OWN,
    "ledger_approvalpolicychange": _OWN,
    "ledger_unknownoutcomepolicy": _OWN,
    "ledger_unknownoutcomepolicychange": _OWN,
    "ledger_resolutionproposal": _OWN_OF_OPERATION,
    "ledger_operationnote": _OWN_OF_OPERATION,
    "ledger_claim": _OWN_OF_OPERATION,
    "ledger_savedview": _OWN,
    "ledger_chainhead": _OWN,
    "ledger_chainanchor": _OWN,
    "ledger_redaction": _OWN,
    "ledger_auditcheckpoint": _OWN,
    "ledger_recordlink": _OWN,
    "ledger_retentionpolicy": _OWN,
    "ledger_stateretentionpolicy": _OWN,
    "ledger_notificationchannel": _OWN,
    "ledger_notificationchannelchange": _OWN,
    "ledger_notificationbatch": _OWN,
    "ledger_notificationsent": _OF_OPERATION,
    "ledger_deliveryattempt": _OWN,
    "ledger_tenantaccess": _OWN,
    "ledger_tenantaccesschange": _OWN,
    # a key is seen by a login limited to all of the key's tenants
    "ledger_agentkey": "tenants <@ to_jsonb({tenants})",
    "ledger_agentkeychange": "tenants <@ to_jsonb({tenants})",
    # rows of no tenant, or of every tenant (a verification's heads, a purge's counts)
    "ledger_auditverification": "false",
    "ledger_purgerun": "false",
    "ledger_retentionchange": "false",
    "ledger_workerlock": "false",
}
# Its own policy (migration 0048): a login reads its own rows only.
LOGIN_TENANT_TABLE = "ledger_logintenant"
TENANT_POLICY = "ledger_tenant_rows"
def tenant_policy(table: str, limited: dict[str, list[str]]) -> str:
    """The USING / WITH CHECK expression of `table`'s tenant policy, given the logins of
    this database limited to tenants, {login: its tenants}. The logins and their tenants
    are written into the policy: a session is held to the condition with the tenants of
    its session user (the login: `SET ROLE` cannot shed it) and with those of its current
    user (the owner's `SET ROLE acme_agent` acts as that login), each when limited; any
    other session passes on a comparison with constants, without a function call or a
    read of ledger_logintenant. With no limited login, the policy is `true`."""
    if not limited:
        return "true"
    held, condition = [], TENANT_ROWS[table]
    for user in ("session_user", "current_user"):
        tenants = (f"(CASE {user}::text "
                   + " ".join(f"WHEN {_literal(login)} THEN ARRAY["
                              + ", ".join(_literal(t) for t in sorted(names)) + "]::text[]"
                              for login, names in sorted(limited.items()))
                   + " END)")
        held.append((tenants, condition.format(tenants=tenants, row=_quote(table))))
    if "{tenants}" not in condition:  # a parent's policy decides: one check, not two
        return f"({held[0][0]} IS NULL AND {held[1][0]} IS NULL) OR ({held[0][1]})"
    return " AND ".join(f"({tenants} IS NULL OR ({held_to}))" for tenants, held_to in held)


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


# SECURITY DEFINER functions (owned by the tables' owner) and who may call them.
FUNCTIONS: dict[str, tuple[str, ...]] = {
    "ledger_retention_purge(bigint, bigint[])": (RECONCILER,),
    "ledger_retention_redact(bigint, bigint[])": (RECONCILER,),
    "ledger_retention_purge_state(bigint, bigint[])": (RECONCILER,),
    "ledger_seal_events(varchar, bigint[], varchar[], bigint, varchar)": (RECONCILER,),
    "ledger_seal_links(varchar, varchar, bigint[], varchar[], bigint, varchar)": (RECONCILER,),
    "ledger_person_may(bigint, text, text)": (DESK,),
    "ledger_lease_acquire(text, text, interval)": (AGENT, RECONCILER),
    "ledger_lease_renew(text, text, bigint, interval)": (AGENT, RECONCILER),
    "ledger_lease_release(text, text, bigint)": (AGENT, RECONCILER),
    # the sealer's and the notification loop's locks (ledger.chain, ledger.notifications)
    "ledger_worker_lock(text)": (RECONCILER,),
    # `manage.py check --deploy` (ledger.W122), from any process's login
    "ledger_unlimited_agent_logins()": KINDS,
}

# Django's own tables (auth, sessions, admin log, content types, axes): the desk's alone.
FRAMEWORK_WRITERS = (DESK,)

# Errors another run of db_roles on the same server can cause at the same moment: a role
# created in between (duplicate_object, unique_violation), a catalog row both update.
_RACES = ("42710", "23505", "XX000", "40001", "40P01")


NO_PRIVILEGE = "42501"  # SQLSTATE insufficient_privilege


class DatabaseRefusedByRole(errors.RefusedByRole, ProgrammingError):
    """A ledger PermissionDenied that is also the error it replaces: Django raises its
    ProgrammingError for SQLSTATE 42501 (psycopg's InsufficientPrivilege), so code that
    handles database errors, and raw SQL, see what they saw before; its __cause__ is
    psycopg's error, with `sqlstate` and `diag`."""


def refusal_as_permission_denied(execute, sql, params, many, context):
    """An execute wrapper on every connection (`install`): PostgreSQL's refusal on role
    grounds (SQLSTATE 42501: the role triggers of migration 0030, a missing grant, an
    append-only rule) becomes errors.PermissionDenied with PostgreSQL's message, so that
    every write path, and the HTTP API and MCP (403), report it as a refusal. The one
    place for it: whatever the function, the statement is where it is refused."""
    try:
        return execute(sql, params, many, context)
    except DatabaseError as exc:
        cause = exc.__cause__
        refused = getattr(cause, "sqlstate", None) == NO_PRIVILEGE
        if not refused or isinstance(exc, errors.RefusedByRole):
            raise
        primary = getattr(getattr(cause, "diag", None), "message_primary", None)
        message = primary or str(cause).splitlines()[0]
        if "expected" not in message:  # a grant's refusal names only what was refused
            message = ("expected this session's database role to hold the privilege, found "
                       f"PostgreSQL refusing it: {message}")
        raise DatabaseRefusedByRole(message) from cause


def install(sender=None, connection=None, **kwargs):
    """connection_created: the refusal wrapper first (outermost) among the connection's
    execute wrappers, once per connection object (it survives reconnects)."""
    if connection is not None and refusal_as_permission_denied not in connection.execute_wrappers:
        connection.execute_wrappers.insert(0, refusal_as_permission_denied)


class RolesRefused(Exception):
    """db_roles cannot make the roles safe: what was expected, what was found."""


def apply(*, logins: Iterable[tuple] = ()) -> list[str]:
    """Create or update the three group roles, their grants and the tenant policies, then
    `logins`, each (name, kinds) or (name, kinds, tenants); returns what was done, one line
    each. Runs as the tables' owner."""
    check_migrations()
    done = []
    for kind in KINDS:
        _ensure_role(ROLE[kind], login=False)
    owner = _owner()
    for kind in KINDS:
        _check_safe(ROLE[kind], owner)
    _retry(lambda: _grant_all(owner))
    done.append("roles ledger_agent, ledger_reconciler, ledger_desk: grants in place")
    for name, kinds, *tenants in logins:
        limited = tuple(tenants[0]) if tenants and tenants[0] else ()
        ensure_login(name, kinds, tenants=limited)
        done.append(f"login {name}: member of {', '.join(ROLE[k] for k in kinds)}, "
                    + (f"limited to tenants {', '.join(limited)}" if limited
                       else "every tenant"))
    return done


def check_migrations() -> None:
    """Refuse a database whose migration state is behind the code."""
    from django.db.migrations.executor import MigrationExecutor

    executor = MigrationExecutor(connection)
    plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
    if plan:
        missing = [f"{m.app_label}.{m.name}" for m, backwards in plan if not backwards]
        raise RolesRefused(
            f"expected every migration applied before db_roles, found {len(plan)} missing "
            f"(first: {missing[0] if missing else plan[0][0]}); run manage.py migrate first")


def ensure_login(name: str, kinds: Iterable[str], *, tenants: Iterable[str] = ()) -> None:
    """A LOGIN role `name` in the group roles of `kinds` (and no other of them), limited by
    PostgreSQL to `tenants` (row-level security, TENANT_ROWS), or to none when empty: its
    tenants are replaced by exactly these in the same transaction as its memberships. Only
    an agent's login of that kind alone may be limited (the web login serves every key's
    tenants; the workers serve every tenant)."""
    kinds = tuple(kinds)
    tenants = tuple(dict.fromkeys(tenants))
    if tenants and kinds != (AGENT,):
        raise RolesRefused(f"expected --tenants for a login of kind agent alone, found {name} "
                           f"asked for {', '.join(kinds) or 'no kind'}")
    for tenant in tenants:
        try:
            check_identifier(tenant, "tenant", 100)
        except errors.InvalidInput as exc:
            raise RolesRefused(f"login {name}: {exc}") from exc
    unknown = [k for k in kinds if k not in ROLE]
    if not kinds or unknown:
        raise RolesRefused(f"expected a login's kinds among {', '.join(KINDS)}, found "
                           f"{', '.join(unknown) or 'none'} for {name}")
    if len(kinds) > 1 and AGENT not in kinds:
        raise RolesRefused(f"expected a login of several kinds to include agent (its sessions "
                           f"start as the agent), found {name} asked for {', '.join(kinds)}")
    if AGENT in kinds and RECONCILER in kinds:
        raise RolesRefused(f"expected an agent's login never to act as a reconciler, found "
                           f"{name} asked for both")
    _ensure_role(name, login=True)
    owner = _owner()
    _check_safe(name, owner)

    def memberships():
        with transaction.atomic(), connection.cursor() as cursor:
            for kind in KINDS:
                verb = "GRANT {} TO {}" if kind in kinds else "REVOKE {} FROM {}"
                cursor.execute(verb.format(_quote(ROLE[kind]), _quote(name)))
            # A login of more than one kind (the web process: agent and desk) starts every
            # session as the agent; the desk's requests become ledger_desk for their
            # duration (RequestRoleMiddleware). A path that forgets to choose is an agent.
            if len(kinds) > 1:
                cursor.execute(f"ALTER ROLE {_quote(name)} SET role = {_quote(ROLE[AGENT])}")
            else:
                cursor.execute(f"ALTER ROLE {_quote(name)} RESET role")
            before = _limited_logins(cursor)
            cursor.execute(f"DELETE FROM {LOGIN_TENANT_TABLE} WHERE login = %s", [name])
            for tenant in tenants:
                cursor.execute(f"INSERT INTO {LOGIN_TENANT_TABLE} (login, tenant) "
                               "VALUES (%s, %s)", [name, tenant])
            if _limited_logins(cursor) != before:  # the policies name logins and tenants
                _tenant_policies(cursor)
    _retry(memberships)


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _owner() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT tableowner FROM pg_tables WHERE schemaname = 'public' "
                       "AND tablename = 'ledger_operation'")
        row = cursor.fetchone()
    if row is None:
        raise RolesRefused("expected the ledger's tables (ledger_operation), found none: "
                           "run manage.py migrate first")
    return row[0]


def _ensure_role(name: str, *, login: bool) -> None:
    """CREATE ROLE unless it exists; another run creating it at the same moment is fine."""
    def create():
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SELECT rolcanlogin FROM pg_roles WHERE rolname = %s", [name])
            row = cursor.fetchone()
            if row is None:
                cursor.execute(f"CREATE ROLE {_quote(name)} {'LOGIN' if login else 'NOLOGIN'}")
            elif row[0] != login:
                cursor.execute(f"ALTER ROLE {_quote(name)} {'LOGIN' if login else 'NOLOGIN'}")
    _retry(create)


def _retry(step, attempts: int = 6) -> None:
    for attempt in range(attempts):
        try:
            step()
            return
        except DatabaseError as exc:
            state = getattr(exc.__cause__, "sqlstate", None)
            if state not in _RACES or attempt == attempts - 1:
                raise
            time.sleep(0.05 * (attempt + 1))


def _check_safe(role: str, owner: str) -> None:
    """Refuse a role that is a superuser or a member of the tables' owner: it could switch
    the ledger's rules off."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT rolsuper OR rolbypassrls, pg_has_role(%s, %s, 'MEMBER') "
            "FROM pg_roles WHERE rolname = %s", [role, owner, role])
        superuser, member = cursor.fetchone()
    if superuser or member:
        raise RolesRefused(
            f"expected role {role} to be no superuser and no member of the tables' owner "
            f"{owner}, found {'a superuser' if superuser else f'a member of {owner}'}, "
            "which could switch the ledger's rules off")


def _grant_all(owner: str) -> None:
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public' "
                       "ORDER BY tablename")
        tables = [name for (name,) in cursor.fetchall()]
        unknown = [t for t in tables if t.startswith("ledger_") and t not in LEDGER_WRITES]
        if unknown:
            raise RolesRefused(
                f"expected every ledger table in ledger.db_roles.LEDGER_WRITES, found "
                f"{', '.join(unknown)} missing: decide who may write it")
        roles = ", ".join(_quote(ROLE[k]) for k in KINDS)
        for statement in (
            f"REVOKE ALL ON ALL TABLES IN SCHEMA public FROM {roles}",
            f"REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM {roles}",
            f"REVOKE ALL ON ALL FUNCTIONS IN SCHEMA public FROM {roles}",
            f"REVOKE CREATE ON SCHEMA public FROM {roles}",
            f"GRANT USAGE ON SCHEMA public TO {roles}",
        ):
            cursor.execute(statement)
        for table in tables:
            if table.startswith("ledger_"):
                cursor.execute(f"GRANT SELECT ON {_quote(table)} TO {roles}")
                for kind, writes in LEDGER_WRITES[table].items():
                    cursor.execute(f"GRANT {writes} ON {_quote(table)} TO {_quote(ROLE[kind])}")
            elif table == "django_migrations":
                # every process may ask whether its code's migrations are applied
                cursor.execute(f"GRANT SELECT ON {_quote(table)} TO {roles}")
            else:
                desk = ", ".join(_quote(ROLE[k]) for k in FRAMEWORK_WRITERS)
                cursor.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {_quote(table)} "
                               f"TO {desk}")
        cursor.execute("SELECT c.relname, d.refobjid::regclass::text FROM pg_class c "
                       "JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = 'public' "
                       "LEFT JOIN pg_depend d ON d.objid = c.oid AND d.deptype IN ('a', 'i') "
                       "AND d.refobjsubid > 0 WHERE c.relkind = 'S'")
        for sequence, table in cursor.fetchall():
            for kind in KINDS:
                if table is None:
                    continue
                writes = LEDGER_WRITES.get(table, {}).get(kind, "") if table.startswith(
                    "ledger_") else ("INSERT" if kind in FRAMEWORK_WRITERS else "")
                if "INSERT" in writes:
                    cursor.execute(f"GRANT USAGE, SELECT ON SEQUENCE {_quote(sequence)} "
                                   f"TO {_quote(ROLE[kind])}")
        for function, kinds in FUNCTIONS.items():
            cursor.execute(f"GRANT EXECUTE ON FUNCTION {function} TO "
                           + ", ".join(_quote(ROLE[k]) for k in kinds))
        _tenant_policies(cursor, [t for t in tables if t.startswith("ledger_")])


def _tenant_policies(cursor, tables: list[str] | None = None) -> None:
    """Row-level security on every ledger table, one policy each from TENANT_ROWS and the
    logins limited to tenants (replaced on every run, and whenever a login's tenants
    change: `ensure_login`)."""
    if tables is None:
        cursor.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public' "
                       "AND tablename LIKE 'ledger\\_%' ORDER BY tablename")
        tables = [name for (name,) in cursor.fetchall()]
    unknown = [t for t in tables if t not in TENANT_ROWS and t != LOGIN_TENANT_TABLE]
    if unknown:
        raise RolesRefused(
            f"expected every ledger table in ledger.db_roles.TENANT_ROWS, found "
            f"{', '.join(unknown)} missing: decide which of its rows a tenant-limited "
            "login may touch")
    limited = _limited_logins(cursor)
    for table in tables:
        if table == LOGIN_TENANT_TABLE:
            continue
        condition = tenant_policy(table, limited)
        cursor.execute(f"ALTER TABLE {_quote(table)} ENABLE ROW LEVEL SECURITY")
        cursor.execute(f"DROP POLICY IF EXISTS {TENANT_POLICY} ON {_quote(table)}")
        cursor.execute(f"CREATE POLICY {TENANT_POLICY} ON {_quote(table)} FOR ALL TO PUBLIC "
                       f"USING ({condition}) WITH CHECK ({condition})")


def _limited_logins(cursor) -> dict[str, list[str]]:
    cursor.execute(f"SELECT login, array_agg(tenant::text ORDER BY tenant) "
                   f"FROM {LOGIN_TENANT_TABLE} GROUP BY login ORDER BY login")
    return dict(cursor.fetchall())


def session_role() -> tuple[str, str, bool, bool]:
    """(current_user, session_user, superuser, member of the tables' owner) of this
    process's connection: `manage.py check --deploy` warns about the last two."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT current_user, session_user, r.rolsuper, "
            "COALESCE((SELECT pg_has_role(session_user, t.tableowner, 'MEMBER') "
            "            FROM pg_tables t WHERE t.schemaname = 'public' "
            "             AND t.tablename = 'ledger_operation'), false) "
            "FROM pg_roles r WHERE r.rolname = session_user")
        return cursor.fetchone()


# --- the web process: each request's database work as its kind's role --------------------

# Paths served to agents (the HTTP API, MCP) and to machines (health, metrics): the agent's
# role. Everything else (the desk, the admin, logins) is the desk's.
AGENT_PREFIXES = ("/api/", "/mcp", "/healthz", "/metrics", "/static/")

_switching: bool | None = None

_SWITCHES = (
    "SELECT NOT r.rolsuper"
    "   AND EXISTS (SELECT FROM pg_roles a WHERE a.rolname = 'ledger_agent'"
    "                AND pg_has_role(session_user, a.oid, 'MEMBER'))"
    "   AND EXISTS (SELECT FROM pg_roles d WHERE d.rolname = 'ledger_desk'"
    "                AND pg_has_role(session_user, d.oid, 'MEMBER'))"
    " FROM pg_roles r WHERE r.rolname = session_user"
)


def switches_roles(cursor) -> bool:
    """Whether this process's login is one that becomes a kind's role per request: no
    superuser, a member of ledger_agent and of ledger_desk (the web process's login,
    `db_roles --login NAME=agent,desk`). Asked once per process, on `cursor` (a DB-API
    cursor)."""
    global _switching
    if _switching is None:
        cursor.execute(_SWITCHES)
        _switching = bool(cursor.fetchone()[0])
    return _switching


def kind_of_path(path: str) -> str:
    return AGENT if path.startswith(AGENT_PREFIXES) else DESK


class RequestRoleMiddleware:
    """A desk request's database work runs as ledger_desk; everything else stays
    ledger_agent, which every session of the web login starts as (`ensure_login`).

    The role is the transaction's, never the session's: each transaction of a desk request
    starts with `SET LOCAL ROLE ledger_desk`, and a statement outside Django's transactions
    (autocommit) runs in one of its own, `BEGIN; SET LOCAL ROLE ledger_desk`, the statement,
    `COMMIT`. So the session stays ledger_agent between transactions, and a connection a
    transaction-pooling PgBouncer hands to another client after a COMMIT (docs/SCALING.md),
    or the process's pool to the next request, can do no more than an agent. A request that
    reads nothing touches no connection. Only when the process's login may become both
    (`switches_roles`); a login of one kind, the owner or a superuser is left as it is.
    First in MIDDLEWARE but for the request id's (config.logs), which reads nothing."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if kind_of_path(request.path) != DESK:
            return self.get_response(request)
        switches = []
        with connection.execute_wrapper(functools.partial(_as_desk, switches)):
            return self.get_response(request)


_SET_DESK = f"SET LOCAL ROLE {ROLE[DESK]}"


def _as_desk(switches: list, execute, sql, params, many, context):
    """`execute` as ledger_desk, in a transaction that set the role (RequestRoleMiddleware).
    The role's statements go on a cursor of their own: the one `execute` fills is the
    caller's to read."""
    pg = context["connection"].connection
    if not switches:
        with pg.cursor() as own:
            switches.append(switches_roles(own))
    if not switches[0] or pg.info.transaction_status != TransactionStatus.IDLE:
        return execute(sql, params, many, context)  # the role was set when it began
    if not context["connection"].get_autocommit():
        pg.execute(_SET_DESK, prepare=False)  # psycopg begins Django's transaction with it
        return execute(sql, params, many, context)
    pg.execute(f"BEGIN; {_SET_DESK}", prepare=False)
    try:
        result = execute(sql, params, many, context)
    except BaseException:
        if pg.info.transaction_status != TransactionStatus.UNKNOWN:
            pg.execute("ROLLBACK", prepare=False)
        raise
    pg.execute("COMMIT", prepare=False)
    return result


def check_login(app_configs=None, **kwargs):
    """`manage.py check --deploy`: warn when this process's login is a superuser or a
    member of the tables' owner (it could switch the ledger's rules off), and about each
    agent login PostgreSQL limits to no tenant."""
    from django.core.checks import Warning

    try:
        current, session, superuser, owner = session_role()
    except DatabaseError:
        return []  # no database to ask (a check before the server exists): nothing to judge
    found = []
    if superuser or owner:
        what = "a superuser" if superuser else "the tables' owner or a member of it"
        found.append(Warning(
            f"expected this process to log in as one kind's login (manage.py db_roles "
            f"--login; docs/security.md), found {session}, {what}: it could switch the "
            "ledger's rules off and act as any kind of actor",
            hint="create the logins with manage.py db_roles --login NAME=KIND and set "
                 "DATABASE_URL (or LEDGER_DATABASE_USER) of each process to its own",
            id="ledger.W121"))
    return found + _unlimited_agent_logins()


def _unlimited_agent_logins():
    """ledger.W122: an agent's login (of kind agent alone) that PostgreSQL limits to no
    tenant reads and writes every tenant's rows; the API's scoping is then Python's alone."""
    from django.core.checks import Warning

    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SELECT ledger_unlimited_agent_logins()")
            names = [name for (name,) in cursor.fetchall()]
    except DatabaseError:
        return []  # a database before migration 0048, or no roles yet: nothing to judge
    return [Warning(
        f"expected every agent login limited by PostgreSQL to its tenants, found {name} "
        "limited to none: an in-process agent logged in as it reads and writes every "
        "tenant's rows (docs/tenancy.md)",
        hint=f"manage.py db_roles --login {name}=agent --tenants TENANT[,TENANT] (or "
             "LEDGER_SILENCE_CHECKS=ledger.W122 where one agent serves every tenant)",
        id="ledger.W122") for name in names]
