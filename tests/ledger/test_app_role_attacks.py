"""The agent's role cannot switch the ledger's rules off, nor rewrite a settled receipt.

Each attack runs as the agent's role ledger_agent (`manage.py db_roles`, ledger/db_roles.py;
it superseded the single application role of ledger/sql/app_role.sql), with
every trigger named in `pgtrigger.ignore` first: the setting any role may set, which the
triggers honoured until migration 0014. Each statement must be refused by PostgreSQL. The
attacks on rows run a second time as the tables' owner with the same setting: the triggers
alone refuse them, whatever the grants. The sanctioned purge and redaction still work as the
application role, and record themselves.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.db.utils import DatabaseError
from django.utils import timezone

from ledger import (
    access,
    agent_keys,
    chain,
    db_roles,
    episodes,
    facts,
    obligations,
    receipts,
    reconcile,
    retention,
    runs,
)
from ledger.management.commands.app_role import create_app_role
from ledger.models import (
    ChainAnchor,
    Episode,
    Evidence,
    Fact,
    FactConflict,
    Obligation,
    Operation,
    OperationEvent,
    PurgeRun,
    Redaction,
    Step,
)
from ledger.states import State
from tests.factories import OperationFactory, add_evidence
from tests.ledger.test_audit_chain import AUDIT_TABLES, decide_a_conflict
from tests.support.retention import complete_days_ago, retention_admin

ROLE = db_roles.ROLE[db_roles.AGENT]
RECONCILER = db_roles.ROLE[db_roles.RECONCILER]
DESK = db_roles.ROLE[db_roles.DESK]
LEGACY = "ledger_app_test"  # manage.py app_role's single role, still made on request
NO_PRIVILEGE = "42501"
CHECK = "23514"


@dataclass
class World:
    """Rows worth attacking, written the sanctioned way before the attacker arrives."""

    submitted: Operation
    succeeded: Operation
    old: Operation  # succeeded, completed long ago (for the purge functions)
    fact_superseded: Fact
    obligation: Obligation
    step: Step
    trigger: str  # the installed name of the transition check
    run: PurgeRun


def every_trigger() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT tgname FROM pg_trigger WHERE tgname LIKE 'pgtrigger_%' "
                       "AND tgrelid::regclass::text LIKE 'ledger\\_%'")
        return [name for (name,) in cursor.fetchall()]


@pytest.fixture
def world(db) -> World:
    db_roles.apply()
    submitted = OperationFactory(state=State.SUBMITTED)
    succeeded = OperationFactory(state=State.SUCCEEDED)
    Evidence.objects.create(operation=succeeded, reconciler="r", query={"q": 1},
                            observed={"o": 1}, verdict="found", created_at=timezone.now())
    old = OperationFactory(state=State.SUCCEEDED)
    retention.set_policy("*", purge_after_days=30, redact_after_days=10,
                         user=retention_admin())
    complete_days_ago(old, 5)  # past nothing: the functions must refuse it
    decide_a_conflict("order-1")  # a FactDecision and a superseded fact
    run = runs.start("attack", run_id="run-attack")
    runs.add_step(run, "one")
    runs.start_step(run, "one")
    step = runs.commit_step(run, "one")
    obligations.open(run, "refund", "refund-1")
    obligation = obligations.commit("refund-1", {"ok": True})
    purge_run = PurgeRun.objects.create(
        policy=retention.policies_by_specificity()[0], policy_snapshot={}, actor="attacker",
        batch_size=1, started_at=timezone.now())
    check = next(t for t in every_trigger() if t.startswith("pgtrigger_operation_transition"))
    return World(submitted=submitted, succeeded=succeeded, old=old,
                 fact_superseded=Fact.objects.filter(status="superseded").get(),
                 obligation=obligation, step=step, trigger=check, run=purge_run)


@contextmanager
def as_role(role: str | None):
    """`role` for the block (None: the owner, as the test connects), with every trigger
    named in pgtrigger.ignore, the switch pgtrigger's triggers honoured."""
    with connection.cursor() as cursor:
        if role:
            cursor.execute(f"SET ROLE {role}")
        cursor.execute("SELECT set_config('pgtrigger.ignore', %s, false)",
                       ["{" + ",".join(every_trigger()) + "}"])
        try:
            yield cursor
        finally:
            cursor.execute("RESET pgtrigger.ignore")
            if role:
                cursor.execute("RESET ROLE")


@dataclass
class Attempt:
    """One try: `sql` after `first` (statements without parameters), refused with
    `sqlstate` as the application role; `by_trigger`: a trigger refuses it whoever asks."""

    sql: str
    params: list
    sqlstate: str
    first: tuple[str, ...] = ()
    by_trigger: bool = True


def assert_refused(cursor, attempt: Attempt, *, sqlstate: str | None = None) -> None:
    """The attempt fails, checks deferred to the commit included; nothing of it stays.

    A DDL attempt takes its table lock before PostgreSQL checks ownership: when a session
    left over from another test holds a conflicting lock, PostgreSQL may end the wait as a
    deadlock (40P01) instead; the attempt is then made again, at most three times."""
    for _ in range(3):
        with pytest.raises(DatabaseError) as caught, transaction.atomic():
            for sql in attempt.first:
                cursor.execute(sql)
            cursor.execute(attempt.sql, attempt.params)
            cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")  # what COMMIT would check
        if caught.value.__cause__.sqlstate != "40P01":
            break
    cause = caught.value.__cause__
    if sqlstate:
        assert cause.sqlstate == sqlstate, f"{attempt.sql}: {cause.sqlstate} {cause}"
    cursor.execute("SET CONSTRAINTS ALL DEFERRED")


# --- the attacks ---------------------------------------------------------------------------

SANCTION = "SELECT set_config('ledger.sanctioned', 'retention', true)"


def forged_success(w: World):
    yield Attempt("UPDATE ledger_operation SET state = 'succeeded', external_id = 'forged' "
                  "WHERE id = %s", [w.submitted.pk], CHECK)
    # A legal move and the next version, but no event: refused at the commit.
    yield Attempt("UPDATE ledger_operation SET state = 'succeeded', version = version + 1, "
                  "external_id = 'forged', completed_at = now() WHERE id = %s",
                  [w.submitted.pk], CHECK)


def sanctioned_setting_forged(w: World):
    # The marker retention's functions set: the application may set it too, to no avail.
    yield Attempt("UPDATE ledger_operation SET error_detail = 'rewritten' WHERE id = %s",
                  [w.succeeded.pk], CHECK, first=(SANCTION,))
    yield Attempt("DELETE FROM ledger_operationevent WHERE operation_id = %s",
                  [w.succeeded.pk], NO_PRIVILEGE, first=(SANCTION,))


def fact_rewritten_in_place(w: World):
    yield Attempt("UPDATE ledger_fact SET status = 'current', superseded_by_id = NULL "
                  "WHERE id = %s", [w.fact_superseded.pk], CHECK)
    yield Attempt("UPDATE ledger_fact SET value = '\"forged\"' WHERE id = %s",
                  [w.fact_superseded.pk], NO_PRIVILEGE)
    yield Attempt("DELETE FROM ledger_fact WHERE id = %s", [w.fact_superseded.pk], NO_PRIVILEGE)


def obligation_reopened(w: World):
    yield Attempt("UPDATE ledger_obligation SET state = 'open', committed_at = NULL, "
                  "result = NULL WHERE id = %s", [w.obligation.pk], CHECK)
    yield Attempt("DELETE FROM ledger_obligation WHERE id = %s", [w.obligation.pk], NO_PRIVILEGE)


def step_moved_back(w: World):
    yield Attempt("UPDATE ledger_step SET state = 'started', committed_at = NULL WHERE id = %s",
                  [w.step.pk], CHECK)
    yield Attempt("UPDATE ledger_step SET state = 'pending' WHERE id = %s", [w.step.pk], CHECK)
    # No trigger guards deleting a step: the grants do.
    yield Attempt("DELETE FROM ledger_step WHERE id = %s", [w.step.pk], NO_PRIVILEGE,
                  by_trigger=False)


def events_and_evidence_rewritten(w: World):
    yield Attempt("UPDATE ledger_operationevent SET reason = 'nothing happened' "
                  "WHERE operation_id = %s", [w.succeeded.pk], NO_PRIVILEGE)
    yield Attempt("UPDATE ledger_evidence SET verdict = 'absent' WHERE operation_id = %s",
                  [w.succeeded.pk], NO_PRIVILEGE)


def events_and_evidence_deleted(w: World):
    yield Attempt("DELETE FROM ledger_operationevent WHERE operation_id = %s", [w.succeeded.pk],
                  NO_PRIVILEGE)
    yield Attempt("DELETE FROM ledger_evidence WHERE operation_id = %s", [w.succeeded.pk],
                  NO_PRIVILEGE)
    yield Attempt("DELETE FROM ledger_operation WHERE id = %s", [w.succeeded.pk], NO_PRIVILEGE)


def audit_rows_deleted(w: World):
    for table in AUDIT_TABLES:
        yield Attempt(f"DELETE FROM {table}", [], NO_PRIVILEGE)


def settled_receipt_rewritten(w: World):
    op = w.succeeded.pk
    yield Attempt("UPDATE ledger_operation SET external_id = 'forged' WHERE id = %s", [op], CHECK)
    yield Attempt("UPDATE ledger_operation SET completed_at = now() WHERE id = %s", [op], CHECK)
    yield Attempt("UPDATE ledger_operation SET result = '{\"x\": 1}' WHERE id = %s", [op], CHECK)
    # Only the desk may write an intent (an approver's edit of a planned one); the
    # transition trigger refuses any other change of it, whoever asks.
    yield Attempt("UPDATE ledger_operation SET intent = '{}' WHERE id = %s", [op], NO_PRIVILEGE)
    yield Attempt("UPDATE ledger_operation SET intent = '{}', intent_fingerprint = 'forged' "
                  "WHERE id = %s", [op], NO_PRIVILEGE)
    yield Attempt("UPDATE ledger_operation SET intent = '{}' WHERE id = %s", [w.submitted.pk],
                  NO_PRIVILEGE)
    yield Attempt("UPDATE ledger_operation SET target = 'x' WHERE id = %s", [op], NO_PRIVILEGE)
    yield Attempt("UPDATE ledger_operation SET redacted_at = now() WHERE id = %s", [op],
                  NO_PRIVILEGE)


def truncated(w: World):
    for table in [*AUDIT_TABLES, "ledger_operation", "ledger_fact", "ledger_obligation"]:
        yield Attempt(f"TRUNCATE {table} CASCADE", [], NO_PRIVILEGE)


def triggers_switched_off(w: World):
    yield Attempt("ALTER TABLE ledger_operation DISABLE TRIGGER ALL", [], NO_PRIVILEGE)
    yield Attempt(f"ALTER TABLE ledger_operation DISABLE TRIGGER {w.trigger}", [], NO_PRIVILEGE)
    yield Attempt(f"DROP TRIGGER {w.trigger} ON ledger_operation", [], NO_PRIVILEGE)
    yield Attempt("SET session_replication_role = replica", [], NO_PRIVILEGE)
    yield Attempt(f"CREATE OR REPLACE FUNCTION {w.trigger}() RETURNS trigger LANGUAGE plpgsql "
                  "AS $$ BEGIN RETURN NEW; END $$", [], NO_PRIVILEGE)
    yield Attempt("CREATE OR REPLACE FUNCTION ledger_sanctioned(oid) RETURNS boolean "
                  "LANGUAGE sql AS $$ SELECT true $$", [], NO_PRIVILEGE)


def tables_altered(w: World):
    yield Attempt("ALTER TABLE ledger_operation DROP CONSTRAINT operation_state_known", [],
                  NO_PRIVILEGE)
    yield Attempt("ALTER TABLE ledger_operation ADD COLUMN forged text", [], NO_PRIVILEGE)
    yield Attempt(f"ALTER TABLE ledger_operationevent OWNER TO {ROLE}", [], NO_PRIVILEGE)
    yield Attempt("CREATE TABLE public.ledger_forged (id int)", [], NO_PRIVILEGE)
    yield Attempt(f"CREATE TRIGGER forged BEFORE UPDATE ON ledger_operation "
                  f"FOR EACH ROW EXECUTE FUNCTION {w.trigger}()", [], NO_PRIVILEGE)


def tables_shadowed(w: World):
    # The deferred "every change has its event" check reads ledger_operationevent: a
    # temporary table of that name would satisfy it, were the search_path not pinned.
    shadow = ("CREATE TEMP TABLE ledger_operationevent ON COMMIT DROP AS "
              f"SELECT {int(w.submitted.pk)}::bigint AS operation_id, 3 AS version")
    yield Attempt("UPDATE ledger_operation SET state = 'succeeded', version = version + 1, "
                  "completed_at = now() WHERE id = %s", [w.submitted.pk], CHECK,
                  first=(shadow,))


def retention_functions_abused(w: World, refusal: str = CHECK):
    # Too young for the policy (30 days), not terminal, too young to redact (10 days), and
    # a run the caller marked finished. The agent may not call them at all (`refusal`);
    # the reconciler, which runs the purge, is refused by the functions' checks.
    yield Attempt("SELECT ledger_retention_purge(%s, %s)", [w.run.pk, [w.old.pk]], refusal)
    yield Attempt("SELECT ledger_retention_purge(%s, %s)", [w.run.pk, [w.submitted.pk]],
                  refusal)
    yield Attempt("SELECT ledger_retention_redact(%s, %s)", [w.run.pk, [w.succeeded.pk]],
                  refusal)
    finish = f"UPDATE ledger_purgerun SET finished_at = now() WHERE id = {int(w.run.pk)}"
    yield Attempt("SELECT ledger_retention_purge(%s, %s)", [w.run.pk, [w.old.pk]], refusal,
                  first=(finish,))


def retention_functions_called_by_the_agent(w: World):
    yield from retention_functions_abused(w, NO_PRIVILEGE)


ATTACKS = [forged_success, sanctioned_setting_forged, fact_rewritten_in_place,
           obligation_reopened, step_moved_back, events_and_evidence_rewritten,
           events_and_evidence_deleted, audit_rows_deleted, settled_receipt_rewritten,
           truncated, triggers_switched_off, tables_altered, tables_shadowed,
           retention_functions_called_by_the_agent]
# What the triggers alone must refuse, even for the owner under pgtrigger.ignore (the owner
# may TRUNCATE, ALTER and set ledger.sanctioned: it is the maintenance role).
ROW_ATTACKS = [forged_success, fact_rewritten_in_place, obligation_reopened, step_moved_back,
               events_and_evidence_rewritten, events_and_evidence_deleted,
               settled_receipt_rewritten, retention_functions_abused]


def snapshot() -> dict:
    tables = ["ledger_operation", "ledger_operationevent", "ledger_evidence", "ledger_fact",
              "ledger_obligation", "ledger_step", *AUDIT_TABLES]
    with connection.cursor() as cursor:
        state = {}
        for table in tables:
            cursor.execute(f"SELECT md5(coalesce(string_agg(t::text, '|' ORDER BY t.id), '')) "
                           f"FROM {table} t")
            state[table] = cursor.fetchone()[0]
        return state


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.__name__)
def test_the_agent_role_is_refused(world, attack):
    before = snapshot()
    attempts = list(attack(world))
    with as_role(ROLE) as cursor:
        cursor.execute("SELECT current_user, current_setting('pgtrigger.ignore')")
        user, ignored = cursor.fetchone()
        assert user == ROLE and world.trigger in ignored
        for attempt in attempts:
            assert_refused(cursor, attempt, sqlstate=attempt.sqlstate)
    assert snapshot() == before


def test_the_retention_functions_refuse_the_reconciler_that_may_call_them(world):
    before = snapshot()
    with as_role(RECONCILER) as cursor:
        for attempt in retention_functions_abused(world):
            assert_refused(cursor, attempt, sqlstate=attempt.sqlstate)
    assert snapshot() == before


@pytest.mark.parametrize("attack", ROW_ATTACKS, ids=lambda a: a.__name__)
def test_the_triggers_alone_refuse_even_the_owner_under_pgtrigger_ignore(world, attack):
    before = snapshot()
    with as_role(None) as cursor:
        for attempt in attack(world):
            if attempt.by_trigger:
                assert_refused(cursor, attempt)
    assert snapshot() == before


def test_no_installed_trigger_consults_a_session_setting_but_the_sanctioned_marker(db):
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT t.tgname, p.prosrc, p.proconfig FROM pg_trigger t
              JOIN pg_proc p ON p.oid = t.tgfoid
             WHERE NOT t.tgisinternal AND t.tgrelid::regclass::text LIKE 'ledger\\_%%'
            """
        )
        rows = cursor.fetchall()
    assert len(rows) >= 20
    for name, source, config in rows:
        assert "_pgtrigger_should_ignore" not in source, name
        assert "current_setting" not in source, name
        assert config == ["search_path=public, pg_temp"], name


def test_the_role_script_refuses_a_role_that_could_switch_the_rules_off(db):
    with connection.cursor() as cursor:
        cursor.execute("SELECT tableowner FROM pg_tables WHERE tablename = 'ledger_operation'")
        owner = cursor.fetchone()[0]
    with pytest.raises(DatabaseError, match="expected an application role that is no "
                                            "superuser"), transaction.atomic():
        create_app_role(owner)


def table_wide_writes(role: str) -> set[tuple[str, str]]:
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT c.relname, p.privilege_type FROM pg_class c
              JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = 'public'
             CROSS JOIN unnest(ARRAY['UPDATE', 'DELETE', 'TRUNCATE', 'REFERENCES',
                                     'TRIGGER']) AS p(privilege_type)
             WHERE c.relkind = 'r' AND c.relname LIKE 'ledger\\_%%'
               AND has_table_privilege(%s, c.oid, p.privilege_type)
            """, [role])
        return set(cursor.fetchall())


def test_the_legacy_app_role_holds_no_write_beyond_what_the_api_needs(db):
    create_app_role(LEGACY)
    # Table-wide UPDATE or DELETE only where the desk edits and removes rows.
    assert table_wide_writes(LEGACY) == {
        ("ledger_retentionpolicy", "UPDATE"), ("ledger_retentionpolicy", "DELETE"),
        ("ledger_stateretentionpolicy", "UPDATE"), ("ledger_stateretentionpolicy", "DELETE"),
        ("ledger_approvalpolicy", "UPDATE"), ("ledger_tenantaccess", "DELETE"),
        ("ledger_claim", "DELETE"), ("ledger_savedview", "DELETE")}


def test_only_the_desk_holds_a_table_wide_write(world):
    assert table_wide_writes(ROLE) == table_wide_writes(RECONCILER) == set()
    assert table_wide_writes(DESK) == {
        ("ledger_retentionpolicy", "UPDATE"), ("ledger_retentionpolicy", "DELETE"),
        ("ledger_stateretentionpolicy", "UPDATE"), ("ledger_stateretentionpolicy", "DELETE"),
        ("ledger_approvalpolicy", "UPDATE"), ("ledger_tenantaccess", "DELETE"),
        ("ledger_claim", "DELETE"), ("ledger_savedview", "DELETE")}


def test_the_agent_role_holds_no_write_beyond_what_the_api_needs(world):
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT c.relname, p.privilege_type FROM pg_class c
              JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = 'public'
             CROSS JOIN unnest(ARRAY['UPDATE', 'DELETE', 'TRUNCATE', 'REFERENCES',
                                     'TRIGGER']) AS p(privilege_type)
             WHERE c.relkind = 'r' AND c.relname LIKE 'ledger\\_%%'
               AND has_table_privilege(%s, c.oid, p.privilege_type)
            """, [ROLE])
        table_rights = set(cursor.fetchall())
        cursor.execute(
            """
            SELECT attname FROM pg_attribute
             WHERE attrelid = 'ledger_operation'::regclass AND attnum > 0
               AND has_column_privilege(%s, attrelid, attnum, 'UPDATE')
            """, [ROLE])
        operation_columns = {name for (name,) in cursor.fetchall()}
        cursor.execute("SELECT has_schema_privilege(%s, 'public', 'CREATE')", [ROLE])
        can_create = cursor.fetchone()[0]
    assert table_rights == set()
    assert not can_create
    assert operation_columns.isdisjoint({
        "id", "operation_id", "tenant", "operation", "target", "account", "idempotency_key",
        "retry_policy", "created_at", "redacted_at", "run_id", "step_id", "intent",
        "intent_fingerprint"})
    assert {"state", "version", "external_id", "conflict"} <= operation_columns


# --- the sanctioned paths, each as its kind's role ------------------------------------------


@contextmanager
def as_app(role: str = ROLE):
    with connection.cursor() as cursor:
        cursor.execute(f"SET ROLE {role}")
        try:
            yield cursor
        finally:
            cursor.execute("RESET ROLE")


def test_purge_and_redaction_work_as_the_reconciler_and_are_recorded(db):
    db_roles.apply()
    retention.set_policy("*", purge_after_days=30, redact_after_days=10,
                         user=retention_admin())
    # Evidence as the reconciler writes it: sealed by the event of its verdict.
    doomed = [OperationFactory(state=State.SUCCEEDED) for _ in range(2)]
    doomed.append(OperationFactory(state=State.RECONCILING))
    add_evidence(doomed[2], verdict="found", to_state=State.SUCCEEDED, query={"q": 1},
                 observed={"o": 1})
    redacted = OperationFactory(state=State.RECONCILING, intent={"secret": "plans"})
    add_evidence(redacted, verdict="found", to_state=State.SUCCEEDED, query={"q": "plans"},
                 observed={"o": "plans"})
    kept = OperationFactory(state=State.SUCCEEDED)  # its events follow the purged ones
    for op in doomed:
        complete_days_ago(op, 40)
    complete_days_ago(redacted, 20)
    events = OperationEvent.objects.filter(operation__in=doomed).count()
    # and an episode of a finished run, past the default 90 days (the state purge)
    said = episodes.record(runs.start("done", run_id="done"), "user", content="ship it")
    with connection.cursor() as cursor:
        cursor.execute("SET session_replication_role = replica")
        cursor.execute("UPDATE ledger_episode SET created_at = now() - interval '100 days'")
        cursor.execute("RESET session_replication_role")

    with as_app(RECONCILER) as cursor:
        cursor.execute("SELECT current_user")
        assert cursor.fetchone() == (RECONCILER,)
        result = retention.purge(actor="nightly", batch=2)
        assert chain.verify(actor="test").is_intact

    assert sorted(result.purged_operation_ids) == sorted(op.operation_id for op in doomed)
    assert result.redacted_operation_ids == [redacted.operation_id]
    assert result.purged_state_ids == [said.pk] and not Episode.objects.exists()
    run = PurgeRun.objects.get(dry_run=False, state_policy=None)
    assert (run.operations_purged, run.events_purged, run.evidence_purged) == (3, events, 1)
    assert (run.operations_redacted, run.evidence_redacted) == (1, 1)
    assert (run.first_operation_id, run.last_operation_id) == (
        min(result.purged_operation_ids), max(result.purged_operation_ids))
    assert ChainAnchor.objects.filter(purge_run=run).exists()
    record = Redaction.objects.get()
    assert (record.operation_ref, record.evidence_rows, record.purge_run) == (
        redacted.operation_id, 1, run)
    redacted.refresh_from_db()
    assert redacted.intent == retention.REDACTED_PAYLOAD and redacted.redacted_at
    evidence = Evidence.objects.get(operation=redacted)
    assert evidence.query == evidence.observed == retention.REDACTED_PAYLOAD
    assert not Operation.objects.filter(pk__in=[op.pk for op in doomed]).exists()
    assert Operation.objects.filter(pk=kept.pk).exists()


@reconcile.register("app_role.found")
class FoundIt(reconcile.Reconciler):
    def lookup(self, op):
        return reconcile.Found("ext-9", {"id": "ext-9"})


def test_everyday_work_runs_each_part_as_its_kinds_role(db):
    db_roles.apply()
    admin = retention_admin()
    lost = OperationFactory(state=State.OUTCOME_UNKNOWN, operation="app_role.found")
    with as_app(RECONCILER):
        assert reconcile.run_once(worker="w-app") == 1
        retention.purge(actor="nightly", dry_run=True, now=timezone.now() + timedelta(days=1))
    with as_app(DESK):
        key, secret = agent_keys.create("app-agent", tenants=["t"], user=admin)
    with as_app(ROLE):
        assert agent_keys.authenticate(secret) == key
    with as_app(DESK):
        agent_keys.revoke("app-agent", user=admin)
        access.grant(admin, "t", by=admin)
        access.revoke(admin, "t", by=admin)
    with as_app(ROLE):
        op = receipts.record_intent("articles.create", "t", {"title": "as the app"})
        receipts.mark_submitted(op)
        receipts.mark_outcome_unknown(op, error_code="Timeout", detail="no answer")
    with as_app(DESK):
        receipts.resolve(op, State.SUCCEEDED, user=admin, reason="seen in the CMS",
                         external_id="a-1")
    with as_app(ROLE):
        twin = receipts.record_intent("articles.create", "t", {"title": "as the app"},
                                      idempotency_key="again")
        receipts.mark_submitted(twin)
        receipts.mark_succeeded(twin, external_id="a-2")  # flags op as a duplicate
        run = runs.start("nightly", run_id="run-app")
        runs.add_step(run, "one")
        runs.start_step(run, "one")
        runs.commit_step(run, "one")
        obligations.open(run, "refund", "refund-app")
        obligations.cancel("refund-app", reason="not needed")
        facts.assert_fact("order-app", "status", "paid", source="agent-a")
        facts.assert_fact("order-app", "status", "refunded", source="agent-b")
    decider = retention_admin("r-order-app")
    with as_app(DESK):
        facts.resolve_conflict(FactConflict.objects.get(subject="order-app"),
                               winner="candidate", user=decider, reason="the bank says so")
        policy = retention.set_policy("articles.*", purge_after_days=60, user=admin)
        retention.delete_policy(policy, user=admin)
    op.refresh_from_db()
    assert (op.state, op.external_id, op.conflict) == (State.SUCCEEDED, "a-1", "duplicate")
    lost.refresh_from_db()
    assert (lost.state, lost.external_id) == (State.SUCCEEDED, "ext-9")
    assert Evidence.objects.filter(operation=lost, verdict="found").exists()


def test_a_settled_receipt_refuses_naming_the_columns_and_its_conflict_flag_needs_its_event(
        world):
    op = world.succeeded
    with as_app() as cursor:
        with pytest.raises(DatabaseError, match=(
                rf"operation {op.operation_id}: expected a settled receipt \(abandoned, "
                r"rejected, succeeded\) to stay as it is .* found an UPDATE of completed_at, "
                r"external_id in state succeeded")), transaction.atomic():
            cursor.execute("UPDATE ledger_operation SET external_id = 'forged', "
                           "completed_at = now() WHERE id = %s", [op.pk])
        # The flag is not the receipt, but it changes only with its event (issue 41): a
        # flag's own, or the success of a twin in the same statement.
        with pytest.raises(DatabaseError, match=(
                rf"operation {op.operation_id}: expected its conflict mark to change only "
                r"with its event .* found an UPDATE of conflict '' -> 'duplicate'")), \
                transaction.atomic():
            cursor.execute("UPDATE ledger_operation SET conflict = 'duplicate' WHERE id = %s",
                           [op.pk])
    op.refresh_from_db()
    assert (op.conflict, op.external_id) == ("", "")
