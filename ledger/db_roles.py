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

import time
from collections.abc import Iterable

from django.db import DatabaseError, ProgrammingError, connection, transaction

from ledger import errors

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
    # the chains' heads: the upsert of ledger.chain (people's decisions on facts); the
    # operation events' heads move in ledger_seal_events
    "ledger_chainhead": {DESK: "INSERT, UPDATE (seq, hash)"},
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
    "ledger_agentkey": {DESK: "INSERT, UPDATE (revoked_at, revoked_by_name)"},
}

# SECURITY DEFINER functions (owned by the tables' owner) and who may call them.
FUNCTIONS: dict[str, tuple[str, ...]] = {
    "ledger_retention_purge(bigint, bigint[])": (RECONCILER,),
    "ledger_retention_redact(bigint, bigint[])": (RECONCILER,),
    "ledger_retention_purge_state(bigint, bigint[])": (RECONCILER,),
    "ledger_seal_events(varchar, bigint[], varchar[], bigint, varchar)": (RECONCILER,),
    "ledger_person_may(bigint, text, text)": (DESK,),
    "ledger_lease_acquire(text, text, interval)": (AGENT, RECONCILER),
    "ledger_lease_renew(text, text, bigint, interval)": (AGENT, RECONCILER),
    "ledger_lease_release(text, text, bigint)": (AGENT, RECONCILER),
    # the sealer's and the notification loop's locks (ledger.chain, ledger.notifications)
    "ledger_worker_lock(text)": (RECONCILER,),
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


def apply(*, logins: Iterable[tuple[str, tuple[str, ...]]] = ()) -> list[str]:
    """Create or update the three group roles and their grants, then `logins`; returns
    what was done, one line each. Runs as the tables' owner."""
    check_migrations()
    done = []
    for kind in KINDS:
        _ensure_role(ROLE[kind], login=False)
    owner = _owner()
    for kind in KINDS:
        _check_safe(ROLE[kind], owner)
    _retry(lambda: _grant_all(owner))
    done.append("roles ledger_agent, ledger_reconciler, ledger_desk: grants in place")
    for name, kinds in logins:
        ensure_login(name, kinds)
        done.append(f"login {name}: member of {', '.join(ROLE[k] for k in kinds)}")
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


def ensure_login(name: str, kinds: Iterable[str]) -> None:
    """A LOGIN role `name` in the group roles of `kinds` (and no other of them)."""
    kinds = tuple(kinds)
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

    Before a desk request's first statement, `SET ROLE ledger_desk`; after the request,
    `SET ROLE ledger_agent` again, so that a connection kept between requests (the pool)
    can do no more than an agent. A request that reads nothing touches no connection.
    Only when the process's login may become both (`switches_roles`); a login of one kind,
    the owner or a superuser is left as it is. First in MIDDLEWARE but for the request
    id's (config.logs), which reads nothing."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if kind_of_path(request.path) != DESK:
            return self.get_response(request)
        switched = []

        def as_desk(execute, sql, params, many, context):
            if not switched:
                raw = context["cursor"].cursor
                switched.append(switches_roles(raw))
                if switched[0]:
                    raw.execute(f"SET ROLE {ROLE[DESK]}")
            return execute(sql, params, many, context)

        try:
            with connection.execute_wrapper(as_desk):
                return self.get_response(request)
        finally:
            if switched and switched[0]:
                try:
                    with connection.cursor() as cursor:
                        cursor.execute(f"SET ROLE {ROLE[AGENT]}")
                except DatabaseError:
                    connection.close()  # a broken connection is not reused as the desk


def check_login(app_configs=None, **kwargs):
    """`manage.py check --deploy`: warn when this process's login is a superuser or a
    member of the tables' owner (it could switch the ledger's rules off)."""
    from django.core.checks import Warning

    try:
        current, session, superuser, owner = session_role()
    except DatabaseError:
        return []  # no database to ask (a check before the server exists): nothing to judge
    if superuser or owner:
        what = "a superuser" if superuser else "the tables' owner or a member of it"
        return [Warning(
            f"expected this process to log in as one kind's login (manage.py db_roles "
            f"--login; docs/security.md), found {session}, {what}: it could switch the "
            "ledger's rules off and act as any kind of actor",
            hint="create the logins with manage.py db_roles --login NAME=KIND and set "
                 "DATABASE_URL (or LEDGER_DATABASE_USER) of each process to its own",
            id="ledger.W121")]
    return []
