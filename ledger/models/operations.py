"""Action receipts: one Operation per logical external action, its events and evidence."""

import pgtrigger
from django.conf import settings
from django.db import models
from django.db.models.functions import MD5

from ledger.chain_content import EVENT_CHAIN_COLUMNS_SQL
from ledger.models.approval_gate import (
    GATE_TRIGGER,
    TWO_PERSON_TRIGGER,
    pattern_matches_sql,
)
from ledger.models.coordination import RUN_LEASE
from ledger.models.triggers import FENCE_HINT, SANCTIONED, SEALING, Protect, Trigger
from ledger.states import (
    TERMINAL,
    ActorKind,
    RetryPolicy,
    State,
    human_decision_check_sql,
    transition_check_sql,
)


# The event must record the change itself (its version, the state it left, the state it
# reached): the event's own checks (human decisions, the fence) then cover the change.
def _event_recorded(from_state: str) -> str:
    return f"""
    IF NOT EXISTS (SELECT 1 FROM ledger_operationevent
                   WHERE operation_id = NEW.id AND version = NEW.version
                     AND from_state = {from_state} AND to_state = NEW.state) THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('operation %s: expected an event recording version %s (state %s) '
                             'in the same transaction, found none; change operations through '
                             'ledger.receipts', NEW.operation_id, NEW.version, NEW.state);
    END IF;
    RETURN NULL;
"""

# Leased runs are fenced (ledger.leases.check_run), by the database too: a change of an
# operation whose run has a lease must carry the lease's current token. The fence follows
# the row's run, not the actor kind the writer names: every agent's change, and every move
# into or out of submitted whoever claims to make it (no person's, reconciler's or system
# move submits a call; the one move out of submitted that is not the sender's, the sweep's
# submitted -> outcome_unknown, is the reconciler role's alone: ledger_event_actor_check).
# The lease row is share-locked to the commit, so no newer token is handed out before it.
# Not a new receipt (from_state ''): a planned operation has no effect.
_EVENT_FENCED = f"""
    SELECT l.token, l.resource INTO lease
      FROM ledger_operation o
      JOIN ledger_run r ON r.id = o.run_id
      JOIN ledger_lease l ON l.resource = {RUN_LEASE}
     WHERE o.id = NEW.operation_id
       FOR SHARE OF l;
    IF FOUND AND NEW.fencing_token IS DISTINCT FROM lease.token THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('expected the current fencing token %s of %s on the change '
                             '%s -> %s of its operation (actor kind %s), found %s',
                             lease.token, lease.resource, NEW.from_state, NEW.to_state,
                             NEW.actor_kind, COALESCE(NEW.fencing_token::text, 'no token'));
    END IF;
    RETURN NEW;
"""
# Which events the run fence looks at (its WHEN clause: the rest pay nothing).
_EVENT_FENCED_WHEN = (
    f"NEW.from_state > '' AND (NEW.actor_kind NOT IN ('{ActorKind.HUMAN}', "
    f"'{ActorKind.RECONCILER}', '{ActorKind.SYSTEM}') OR NEW.to_state = '{State.SUBMITTED}' "
    f"OR (NEW.from_state = '{State.SUBMITTED}' AND NEW.actor_kind <> '{ActorKind.SYSTEM}'))"
)

# No effect before its dependencies: an operation of a step is submitted (from planned, or
# again from safe_to_retry) only once every step that step depends on is committed. A
# committed step never goes back (step_lifecycle_check), so what this reads stays true
# after the write. The hint names the refusal for ledger.transitions, which raises
# DependencyNotMet; the detail is the missing steps' ids, a JSON array.
DEPENDENCY_HINT = "dependency_not_met"
_SUBMIT_AFTER_DEPENDENCIES = f"""
    SELECT string_agg(dep.step_id || ' ' || dep.state, ', ' ORDER BY dep.step_id),
           to_json(array_agg(dep.step_id ORDER BY dep.step_id))::text
      INTO missing, missing_ids
      FROM ledger_step_depends_on link
      JOIN ledger_step dep ON dep.id = link.to_step_id
     WHERE link.from_step_id = NEW.step_id AND dep.state <> 'committed';
    IF missing IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('expected every step that %s depends on to be committed before '
                             'operation %s (%s) is submitted, found %s',
                             (SELECT step_id FROM ledger_step WHERE id = NEW.step_id),
                             NEW.operation_id, NEW.operation, missing),
            DETAIL = missing_ids,
            HINT = '{DEPENDENCY_HINT}';
    END IF;
    RETURN NEW;
"""

# An action bound to the facts it was planned on (`record_intent(relies_on=)`) is submitted
# (from planned, or again from safe_to_retry) only while each of those fact versions is
# still current and unexpired (its `expires_at`, if any, after the submitting transaction's
# now()), and the versions it relies on never change after the receipt is written.
# The hint names the refusal for ledger.transitions, which raises StaleFact; the detail is
# the id of the first stale version.
STALE_FACT_HINT = "stale_fact"
_SUBMIT_ON_CURRENT_FACTS = f"""
    IF NEW.relies_on IS DISTINCT FROM OLD.relies_on THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('operation %s: expected the fact versions it relies on to stay '
                             '%s, found them changed to %s', NEW.operation_id,
                             OLD.relies_on, NEW.relies_on);
    END IF;
    SELECT string_agg(COALESCE(f.subject || ' ' || f.predicate || ' version '
                               || COALESCE(f.version::text, '(candidate)') || ' ' || f.status
                               || CASE WHEN f.expires_at <= now() THEN ', expired at '
                                       || to_char(f.expires_at AT TIME ZONE 'UTC',
                                                  'YYYY-MM-DD"T"HH24:MI:SS"Z"')
                                  ELSE '' END,
                               'fact ' || r.id_text || ' (gone)'), ', '
                      ORDER BY r.id_text::bigint),
           min(r.id_text::bigint)::text
      INTO stale, stale_id
      FROM jsonb_array_elements_text(NEW.relies_on) AS r(id_text)
      LEFT JOIN ledger_fact f ON f.id = r.id_text::bigint
     WHERE f.id IS NULL OR f.status <> 'current' OR f.expires_at <= now();
    IF stale IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('expected every fact version operation %s (%s) relies on to be '
                             'current when it is submitted, found %s', NEW.operation_id,
                             NEW.operation, stale),
            DETAIL = stale_id,
            HINT = '{STALE_FACT_HINT}';
    END IF;
    RETURN NEW;
"""

# A reconciler's change (a claim, a verdict, a re-read's finding) is fenced by its lease
# `reconcile:<operation_id>`: the event must carry that lease's current token, so a worker
# whose lease was taken over cannot record anything, whatever statement it sends. The lease
# row is share-locked to the commit, so no newer token is handed out before it. The hint
# names the refusal for ledger.transitions, which raises StaleFencingToken; the detail is
# the current token ('' without a lease).
_EVENT_RECONCILER_FENCED = f"""
    SELECT l.token, l.resource INTO lease
      FROM ledger_operation o
      JOIN ledger_lease l ON l.resource = 'reconcile:' || o.operation_id
     WHERE o.id = NEW.operation_id
       FOR SHARE OF l;
    IF NOT FOUND OR NEW.fencing_token IS DISTINCT FROM lease.token THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('expected fencing token %s to be current for the reconciler''s '
                             'lease of operation %s (%s -> %s), found %s',
                             COALESCE(NEW.fencing_token::text, 'none'),
                             (SELECT operation_id FROM ledger_operation
                               WHERE id = NEW.operation_id),
                             NEW.from_state, NEW.to_state,
                             CASE WHEN lease.token IS NULL THEN 'no lease at all'
                                  ELSE 'current token ' || lease.token END),
            DETAIL = COALESCE(lease.token::text, ''),
            HINT = '{FENCE_HINT}';
    END IF;
    RETURN NEW;
"""

# The one UPDATE an event admits (the statement trigger admits only the sealer's function):
# its chain position and hash, from unset to set, and nothing else.
_EVENT_SEALED_ONCE = """
    IF OLD.chain_seq IS NOT NULL OR NEW.chain_seq IS NULL
       OR to_jsonb(NEW) - 'chain_seq' - 'chain_hash'
          IS DISTINCT FROM to_jsonb(OLD) - 'chain_seq' - 'chain_hash' THEN
        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',
            MESSAGE = format('operation event %s: expected the sealer to set an unsealed '
                             'event''s chain_seq and chain_hash and nothing else, found '
                             'chain_seq %s -> %s and other columns %s', OLD.id,
                             COALESCE(OLD.chain_seq::text, 'unset'),
                             COALESCE(NEW.chain_seq::text, 'unset'),
                             CASE WHEN to_jsonb(NEW) - 'chain_seq' - 'chain_hash'
                                       IS DISTINCT FROM to_jsonb(OLD) - 'chain_seq' - 'chain_hash'
                                  THEN 'changed' ELSE 'unchanged' END);
    END IF;
    RETURN NEW;
"""

# No column of an operation changes but through a transition that writes its event in the
# same statement (ledger.transitions: the row's UPDATE and the event's INSERT are one
# statement), column by column. A BEFORE trigger holds each column to the changes a
# transition makes of it; an AFTER trigger (at the end of the statement) finds the event.
#
# Without a version step (no transition) only two changes pass: the duplicate mark another
# operation's success sets on its succeeded twins (`duplicate`, in that success's statement,
# which operation_duplicate_with_its_event holds it to),
# and retention's redaction inside its sanctioned function. With one (the transition check
# admits a step only with a state change, a terminal operation's flag or re-read, or an
# approver's intent edit): the columns below only as the named moves change them, the rest
# (target, retry policy, run, step, trace, redaction) never; identity, intent and the facts
# relied on are the transition check's and operation_submit_on_current_facts's.
_STEP_COLUMNS = {
    # column: the condition under which a transition may change it
    "attempt": f"OLD.state = '{State.SAFE_TO_RETRY}' AND NEW.state = '{State.SUBMITTED}' "
               "AND NEW.attempt = OLD.attempt + 1",
    "submitted_at": f"moved AND NEW.state = '{State.SUBMITTED}'",
    "in_flight_until": f"moved AND NEW.state IN ('{State.SUBMITTED}', '{State.OUTCOME_UNKNOWN}')",
    "unknown_since": f"moved AND (NEW.state = '{State.OUTCOME_UNKNOWN}' OR "
                     f"NEW.state = '{State.SUBMITTED}' AND NEW.unknown_since IS NULL)",
    "completed_at": "moved AND NEW.state IN ({terminal})",
    "result": f"moved AND NEW.state = '{State.SUCCEEDED}'",
    "result_unstorable": f"moved AND NEW.state = '{State.SUCCEEDED}'",
    "state_changed_at": "moved",
    "error_code": "moved",
    "error_detail": "moved",
    "next_attempt_at": "moved",
    "reconcile_attempts": "moved",
    "reconcile_failures": "true",
    "reread_due_at": "true",
    "conflict": "true",
    "target": "false",
    "account": "false",
    "retry_policy": "false",
    "run_id": "false",
    "step_id": "false",
    "trace_id": "false",
    "span_id": "false",
    "authentication_recorded": "false",
    "redacted_at": "false",
}


def _refusals() -> list[tuple[str, str]]:
    """(column, the SQL condition under which a version step's change of it is refused)."""
    terminal = ", ".join(f"'{state}'" for state in sorted(TERMINAL))
    moved = "NEW.state IS DISTINCT FROM OLD.state"
    return [
        (column, f"NEW.{column} IS DISTINCT FROM OLD.{column} AND NOT "
                 f"({rule.format(terminal=terminal).replace('moved', f'({moved})')})")
        for column, rule in _STEP_COLUMNS.items()
    ]


# The trigger's WHEN clause: PostgreSQL calls its function only for a change it refuses
# (or one it must look at: an UPDATE without a version step that changes anything, the
# duplicate mark and the redaction among them). A well-formed transition, the write path,
# is decided by the condition alone, without a call (bench P1).
def _columns_by_event_condition() -> str:
    refused = " OR ".join(f"({condition})" for _, condition in _refusals())
    return (f"((OLD.version = NEW.version AND OLD.* IS DISTINCT FROM NEW.*) "
            f"OR (OLD.version IS DISTINCT FROM NEW.version AND ({refused})))")


def _columns_by_event() -> str:
    refused = ",\n           ".join(
        f"CASE WHEN {condition} THEN '{column}' END" for column, condition in _refusals()
    )
    return f"""
    IF NEW.version = OLD.version THEN
        IF {SANCTIONED} THEN
            RETURN NEW;
        END IF;
        SELECT string_agg(n.key, ', ' ORDER BY n.key) INTO changed
          FROM jsonb_each(to_jsonb(NEW)) n
         WHERE n.value IS DISTINCT FROM to_jsonb(OLD) -> n.key
           AND NOT (n.key = 'conflict' AND NEW.conflict = '{Conflict.DUPLICATE}'
                    AND OLD.state = '{State.SUCCEEDED}' AND NEW.state = OLD.state);
        IF changed IS NOT NULL THEN
            RAISE EXCEPTION USING ERRCODE = 'check_violation',
                MESSAGE = format('operation %s: expected a change of its columns to be a '
                                 'transition with its event (version %s -> %s, through '
                                 'ledger.receipts), found an UPDATE of %s at version %s '
                                 'in state %s', OLD.operation_id, OLD.version,
                                 OLD.version + 1, changed, OLD.version, OLD.state);
        END IF;
        RETURN NEW;
    END IF;
    changed := array_to_string(ARRAY[
           {refused}], ', ');
    IF changed <> '' THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('operation %s: expected the transition %s -> %s (version %s) to '
                             'change only what that move changes, found it changing %s',
                             OLD.operation_id, OLD.state, NEW.state, NEW.version, changed);
    END IF;
    RETURN NEW;
"""


# At the end of the statement that stepped the version: that statement wrote the event of
# the new version (same transaction and command: xmin and cmin of both rows), recording the
# move the row made and the external_id it now carries (what the chain covers).
_EVENT_IN_STATEMENT = """
    SELECT e.from_state, e.to_state, e.external_id,
           e.xmin = o.xmin AND e.cmin = o.cmin AS same_statement
      INTO event
      FROM ledger_operationevent e JOIN ledger_operation o ON o.id = e.operation_id
     WHERE e.operation_id = NEW.id AND e.version = NEW.version;
    IF NOT FOUND OR NOT event.same_statement OR event.from_state <> OLD.state
       OR event.to_state <> NEW.state OR event.external_id <> NEW.external_id THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('operation %s: expected the statement changing it to version %s '
                             '(%s -> %s, external_id %L) to write the event of that version, '
                             'found %s; change operations through ledger.receipts',
                             NEW.operation_id, NEW.version, OLD.state, NEW.state,
                             NEW.external_id,
                             CASE WHEN NOT FOUND THEN 'none'
                                  WHEN NOT event.same_statement
                                  THEN 'one written by another statement'
                                  ELSE format('an event of %s -> %s, external_id %L',
                                              event.from_state, event.to_state,
                                              event.external_id) END);
    END IF;
    RETURN NULL;
"""

# The one change of a column without a version step (and so without an event of its own)
# that operation_with_its_event admits, the duplicate mark of a succeeded operation, is the
# mark of its twin's success: at the end of the statement, that statement wrote the event
# of a twin (same tenant, operation and fingerprint) moving to succeeded (the `duplicates`
# CTE of ledger.transitions.CHANGE_OPERATION). A bare UPDATE of the mark, by any role or the
# owner, has no such event and is refused; a person's or a reconciler's flag steps the
# version and writes its own event (CHANGE_FLAG).
_DUPLICATE_WITH_ITS_EVENT = f"""
    PERFORM 1
       FROM ledger_operation me, ledger_operation twin
       JOIN ledger_operationevent e ON e.operation_id = twin.id AND e.version = twin.version
      WHERE me.id = NEW.id
        AND twin.tenant = NEW.tenant AND twin.operation = NEW.operation
        AND twin.intent_fingerprint = NEW.intent_fingerprint AND twin.id <> NEW.id
        AND e.to_state = '{State.SUCCEEDED}' AND e.from_state <> '{State.SUCCEEDED}'
        AND e.xmin = me.xmin AND e.cmin = me.cmin;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('operation %s: expected its conflict mark to change only with '
                             'its event (a flag''s own event, or the duplicate mark written by '
                             'the statement recording a twin''s success), found an UPDATE of '
                             'conflict %L -> %L at version %s with no such event',
                             NEW.operation_id, OLD.conflict, NEW.conflict, NEW.version);
    END IF;
    RETURN NULL;
"""

_TERMINAL_SQL = ", ".join(f"'{state}'" for state in sorted(TERMINAL))
_TERMINAL_TEXT = ", ".join(sorted(TERMINAL))
# The database's own guarantee behind retention: nothing unfinished is ever forgotten.
# Once per DELETE statement, over the deleted rows (a transition table): the purge deletes
# hundreds of operations a batch, and one look at them costs less than a call per row.
_DELETE_TERMINAL_ONLY = f"""
    SELECT operation_id, state INTO unfinished FROM old_values
     WHERE state NOT IN ({_TERMINAL_SQL}) LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('operation %s: expected a terminal operation ({_TERMINAL_TEXT}) '
                             'to delete, found state %s; only the retention purge removes '
                             'operations, and never unfinished ones', unfinished.operation_id,
                             unfinished.state);
    END IF;
    RETURN NULL;
"""

# A settled receipt is the record of what happened: once terminal, only the conflict flag
# (flagging a duplicate, a person's acknowledgement) and the re-read's schedule
# (reread_due_at, reconcile_failures) may change in an ordinary UPDATE;
# redaction (intent, error_detail, redacted_at) only inside the sanctioned retention
# function; everything else (external_id, target, result, completed_at, ...) never.
# State and version are the transition check's (which fires first: triggers fire by name).
_TERMINAL_ALWAYS = ("conflict", "reconcile_failures", "reread_due_at", "state", "version")
_TERMINAL_REDACTION = ("intent", "error_detail", "redacted_at")
_TERMINAL_IMMUTABLE = f"""
    SELECT string_agg(n.key, ', ' ORDER BY n.key) INTO changed
      FROM jsonb_each(to_jsonb(NEW)) n
     WHERE n.value IS DISTINCT FROM to_jsonb(OLD) -> n.key
       AND n.key <> ALL (ARRAY[{", ".join(f"'{c}'" for c in _TERMINAL_ALWAYS)}]::text[])
       AND (n.key <> ALL (ARRAY[{", ".join(f"'{c}'" for c in _TERMINAL_REDACTION)}]::text[])
            OR NOT {SANCTIONED});
    IF changed IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('operation %s: expected a settled receipt ({_TERMINAL_TEXT}) to '
                             'stay as it is (only its conflict flag may change, its intent '
                             'only through the retention redaction), found an UPDATE of %s '
                             'in state %s', OLD.operation_id, changed, OLD.state);
    END IF;
    RETURN NEW;
"""


class AppendOnly(Protect):
    """Refuse every UPDATE and DELETE statement on the table, once per statement.

    A BEFORE trigger at statement level (pgtrigger's own statement-level Protect is an
    AFTER trigger over transition tables, which cannot cover UPDATE and DELETE at once):
    the sanctioned purge and redaction (`ledger_retention_purge`, `ledger_retention_redact`,
    the only callers `ledger_sanctioned` admits; see ledger.models.triggers) pay for one
    check per statement rather than one per row. It refuses even a statement that matches
    no row.
    """

    def __init__(self, *, name: str, sealed: bool = False):
        super().__init__(name=name, operation=pgtrigger.Update | pgtrigger.Delete,
                         level=pgtrigger.Statement)
        self.when = pgtrigger.Before
        # Operation events: the sealer's UPDATE of their chain columns passes too (the row
        # trigger `event_sealed_once` holds it to those columns, set once).
        self.sealed = sealed

    def get_func(self, model):
        admitted = SANCTIONED
        if self.sealed:
            admitted = f"{SANCTIONED} OR (TG_OP = 'UPDATE' AND {SEALING})"
        return f"""
        IF {admitted} THEN
            RETURN NULL;
        END IF;
        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',
            MESSAGE = format('pgtrigger: Cannot update or delete rows from %s table: expected '
                             'only INSERT (it is append-only; retention removes and redacts '
                             'rows through ledger_retention_purge and ledger_retention_redact), '
                             'found %s', TG_TABLE_NAME, TG_OP);
        """


class Conflict(models.TextChoices):
    AMBIGUOUS = "ambiguous", "Several matching effects"
    DUPLICATE = "duplicate", "Another operation with the same fingerprint also succeeded"


class OperationQuerySet(models.QuerySet):
    def needing_review(self):
        from ledger.states import NEEDS_REVIEW

        return self.filter(state__in=NEEDS_REVIEW)

    def for_tenants(self, tenants):
        """`tenants` None means every tenant (superusers)."""
        return self if tenants is None else self.filter(tenant__in=tenants)


# What the desk's search looked inside until migration 0051 (the expression of the trigram
# index migration 0032 put on the operations table): the id, the key and the external id in
# one text, joined by a unit separator no search term holds. Kept for that migration; the
# search now reads OperationSearch.
def search_text_sql(table: str = "") -> str:
    """The expression, its columns qualified by `table` when given (the index takes it
    unqualified; a query joining other tables qualifies it: the planner matches both)."""
    at = f'"{table}".' if table else ""
    return (f"({at}operation_id::text || E'\\x1f' || {at}idempotency_key::text "
            f"|| E'\\x1f' || {at}external_id::text)")


class Operation(models.Model):
    """The receipt of one external action, written before the request is sent.

    Rows change only through `ledger.transitions` (called by receipts and the reconciler);
    a trigger refuses illegal transitions and version jumps even from a raw
    `QuerySet.update()`.
    """

    operation_id = models.CharField(max_length=40, unique=True)
    tenant = models.CharField(max_length=100, default="default")
    operation = models.CharField(max_length=200)
    target = models.CharField(max_length=2000, blank=True)
    # Which account at the provider the call acts as (a Stripe account, a mailbox, a tenant
    # of the provider): a non-secret label, never a credential. Reconcilers read as it, and
    # a positive control is an earlier effect of the same target and account.
    account = models.CharField(max_length=200, blank=True, default="", db_default="")
    intent = models.JSONField(default=dict)
    intent_fingerprint = models.CharField(max_length=80)
    idempotency_key = models.CharField(max_length=200)
    retry_policy = models.CharField(
        max_length=20, choices=RetryPolicy.choices, default=RetryPolicy.IF_ABSENT_PROVEN
    )
    state = models.CharField(max_length=20, choices=State.choices, default=State.PLANNED)
    version = models.PositiveIntegerField(default=1)
    attempt = models.PositiveIntegerField(default=1)
    external_id = models.CharField(max_length=500, blank=True)
    error_code = models.CharField(max_length=200, blank=True)
    error_detail = models.TextField(blank=True)
    authentication_recorded = models.BooleanField(default=False)
    run = models.ForeignKey(
        "ledger.Run", null=True, blank=True, on_delete=models.PROTECT, related_name="operations"
    )
    step = models.ForeignKey(
        "ledger.Step", null=True, blank=True, on_delete=models.PROTECT, related_name="operations"
    )
    created_at = models.DateTimeField()
    state_changed_at = models.DateTimeField()
    submitted_at = models.DateTimeField(null=True, blank=True)
    # Until then the request of the current attempt may still be travelling: a read that
    # finds nothing before it proves nothing (ledger.reconcile keeps the operation unknown).
    in_flight_until = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    # Reconciliation bookkeeping (ledger.reconcile).
    unknown_since = models.DateTimeField(null=True, blank=True)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    reconcile_attempts = models.PositiveIntegerField(default=0)
    reconcile_failures = models.PositiveIntegerField(default=0)
    # When a retried operation is to be read again (ledger.reconcile.reread_due): set as
    # attempt n > 1 is sent, to the end of the latest in-flight window of its attempts;
    # due once the operation has succeeded; cleared by the re-read. A late copy of an
    # earlier attempt that landed beside the retry is then found and flagged duplicate.
    reread_due_at = models.DateTimeField(null=True, blank=True)
    # Why the desk shows this operation although its state alone would not: the reconciler
    # found several matching effects, or another operation with the same fingerprint also
    # succeeded. Kept on the row (and indexed) so the queue never scans history for it.
    conflict = models.CharField(max_length=20, choices=Conflict.choices, blank=True)
    # Set when retention replaced the intent (ledger.retention); fingerprint and ids remain.
    redacted_at = models.DateTimeField(null=True, blank=True)
    # What a `receipts.action` returned (redacted JSON); when it could not be stored (not
    # JSON, too large), `result_unstorable` says why and `result` stays null.
    result = models.JSONField(null=True, blank=True)
    # db_default: rows written in SQL (bulk loaders, other services) need not name it.
    result_unstorable = models.CharField(max_length=300, blank=True, default="", db_default="")
    # The OpenTelemetry trace and span the intent was recorded in (lowercase hex), if any:
    # the desk links the receipt to its trace through LEDGER_TRACE_URL.
    trace_id = models.CharField(max_length=32, blank=True, default="", db_default="")
    span_id = models.CharField(max_length=16, blank=True, default="", db_default="")
    # The fact versions (Fact ids) the action was planned on (`record_intent(relies_on=)`):
    # it is not submitted once one of them is superseded. Set when the receipt is written,
    # never changed (PostgreSQL: operation_submit_on_current_facts).
    relies_on = models.JSONField(default=list, blank=True,
                                 db_default=models.Value([], models.JSONField()))

    objects = OperationQuerySet.as_manager()

    # Not columns: receipts.record_intent sets them on the operation this call inserted,
    # and (submit=True) on the one this call marked submitted.
    recorded_now = False
    submitted_now = False

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "operation", "idempotency_key"],
                condition=models.Q(idempotency_key__gt=""),
                name="operation_idempotency_key_unique",
            ),
            models.CheckConstraint(
                condition=models.Q(state__in=State.values), name="operation_state_known"
            ),
            models.CheckConstraint(
                condition=models.Q(retry_policy__in=RetryPolicy.values),
                name="operation_retry_policy_known",
            ),
            models.CheckConstraint(
                condition=models.Q(authentication_recorded=False),
                name="operation_never_records_authentication",
            ),
        ]
        indexes = [
            models.Index(fields=["state", "state_changed_at", "id"], name="operation_queue_idx"),
            models.Index(fields=["state", "next_attempt_at"], name="operation_reconcile_idx"),
            # A reconciler's claim: the next due outcome_unknown operation, in claim order,
            # without sorting every due row (ledger.reconcile._CLAIM).
            models.Index(
                models.F("next_attempt_at").asc(nulls_first=True), models.F("id").asc(),
                name="operation_due_idx", condition=models.Q(state=State.OUTCOME_UNKNOWN),
            ),
            models.Index(
                fields=["tenant", "operation", "intent_fingerprint"],
                name="operation_fingerprint_idx",
            ),
            models.Index(fields=["external_id"], name="operation_external_id_idx"),
            models.Index(fields=["completed_at"], name="operation_completed_idx"),
            models.Index(fields=["state_changed_at", "id"], name="operation_conflict_idx",
                         condition=models.Q(conflict__gt="")),
            # The re-reads due (ledger.reconcile.claim_reread): few rows, in due order.
            models.Index(fields=["reread_due_at", "id"], name="operation_reread_due_idx",
                         condition=models.Q(state=State.SUCCEEDED, reread_due_at__isnull=False)),
            # A reconciler's positive control: the latest succeeded operation of the same
            # name on the same target and account, with an external id
            # (ledger.reconcile.latest_control). The target is hashed: a 2,000-character
            # target could exceed a btree entry.
            models.Index(
                "tenant", "operation", MD5("target"), "account", "completed_at", "id",
                name="operation_control_idx",
                condition=models.Q(state=State.SUCCEEDED) & ~models.Q(external_id=""),
            ),
        ]
        permissions = [
            ("resolve_operation", "Can resolve operations the ledger cannot prove"),
            ("override_retry_policy", "Can mark a never-retry operation safe to retry"),
        ]
        triggers = [
            Trigger(
                name="operation_transition_check",
                operation=pgtrigger.Update,
                when=pgtrigger.Before,
                func=transition_check_sql(),
            ),
            Trigger(
                name="operation_insert_planned",
                operation=pgtrigger.Insert,
                when=pgtrigger.Before,
                func="""
                IF NEW.state <> 'planned' OR NEW.version <> 1 THEN
                    RAISE EXCEPTION USING ERRCODE = 'check_violation',
                        MESSAGE = format('operation %s: expected a new receipt in state planned '
                                         'at version 1, found state %s at version %s',
                                         NEW.operation_id, NEW.state, NEW.version);
                END IF;
                RETURN NEW;
                """,
            ),
            Trigger(
                name="operation_insert_evented",
                operation=pgtrigger.Insert,
                when=pgtrigger.After,
                timing=pgtrigger.Deferred,
                func=_event_recorded("''"),
            ),
            Trigger(
                name="operation_delete_terminal_only",
                operation=pgtrigger.Delete,
                when=pgtrigger.After,
                level=pgtrigger.Statement,
                referencing=pgtrigger.Referencing(old="old_values"),
                declare=[("unfinished", "record")],
                func=_DELETE_TERMINAL_ONLY,
            ),
            Trigger(
                name="operation_unchanged_when_terminal",
                operation=pgtrigger.Update,
                when=pgtrigger.Before,
                condition=pgtrigger.Q(old__state__in=sorted(TERMINAL)),
                declare=[("changed", "text")],
                func=_TERMINAL_IMMUTABLE,
            ),
            Trigger(
                name="operation_with_its_event",
                operation=pgtrigger.Update,
                when=pgtrigger.Before,
                condition=pgtrigger.Condition(_columns_by_event_condition()),
                declare=[("changed", "text")],
                func=_columns_by_event(),
            ),
            # Every version step (a state change, a terminal operation's flag or re-read,
            # an approver's intent edit) with its event, in the same statement.
            Trigger(
                name="operation_event_in_statement",
                operation=pgtrigger.Update,
                when=pgtrigger.After,
                condition=pgtrigger.Q(old__version__df=pgtrigger.F("new__version")),
                declare=[("event", "record")],
                func=_EVENT_IN_STATEMENT,
            ),
            Trigger(
                name="operation_duplicate_with_its_event",
                operation=pgtrigger.Update,
                when=pgtrigger.After,
                condition=pgtrigger.Condition(
                    "OLD.version = NEW.version AND OLD.conflict IS DISTINCT FROM NEW.conflict"
                ),
                func=_DUPLICATE_WITH_ITS_EVENT,
            ),
            GATE_TRIGGER,
            # Named to fire before the gate (triggers fire in name order): a step's
            # dependencies are the first thing an agent is told it lacks.
            Trigger(
                name="operation_submit_after_dependencies",
                operation=pgtrigger.Update,
                when=pgtrigger.Before,
                condition=pgtrigger.Condition(
                    f"NEW.state = '{State.SUBMITTED}' AND OLD.state <> '{State.SUBMITTED}' "
                    "AND NEW.step_id IS NOT NULL"
                ),
                declare=[("missing", "text"), ("missing_ids", "text")],
                func=_SUBMIT_AFTER_DEPENDENCIES,
            ),
            # Only rows that rely on facts pay for it (the condition), and only as they are
            # submitted, or if someone tries to change what they relied on.
            Trigger(
                name="operation_submit_on_current_facts",
                operation=pgtrigger.Update,
                when=pgtrigger.Before,
                condition=pgtrigger.Condition(
                    "NEW.relies_on IS DISTINCT FROM OLD.relies_on OR ("
                    f"NEW.state = '{State.SUBMITTED}' AND OLD.state <> '{State.SUBMITTED}' "
                    "AND NEW.relies_on <> '[]'::jsonb)"
                ),
                declare=[("stale", "text"), ("stale_id", "text")],
                func=_SUBMIT_ON_CURRENT_FACTS,
            ),
        ]

    def __str__(self):
        return f"{self.operation_id} {self.operation} ({self.state})"

    @property
    def trace_url(self) -> str:
        """The page of the trace this operation was recorded in (`LEDGER_TRACE_URL` filled
        with its ids), or "" without a trace or a template."""
        from ledger import conf

        template = conf.TRACE_URL
        if not (template and self.trace_id):
            return ""
        return template.format(trace_id=self.trace_id, span_id=self.span_id)

    @property
    def is_terminal(self) -> bool:
        from ledger.states import TERMINAL

        return self.state in TERMINAL

    @property
    def needs_review(self) -> bool:
        from ledger.states import NEEDS_REVIEW

        return self.state in NEEDS_REVIEW


class SearchKind(models.TextChoices):
    RECEIPT = "receipt", "The operation id and the idempotency key"
    EXTERNAL = "external", "The external id"


class OperationSearch(models.Model):
    """The strings the desk's search looks inside, beside the operation they name: one row
    of its id and idempotency key (joined by a unit separator no search term holds, so a
    fragment never matches across the two) and, once the external system gave one, a row of
    its external id. A trigram GIN index on `text` serves LIKE '%fragment%'.

    Written by PostgreSQL alone (migration 0051): a SECURITY DEFINER trigger adds the rows
    when an operation is inserted and when its external id is set, and removes them with
    the operation; no role may write here. Beside the operation, not on it, so that a
    transition (which rewrites the operation's row) writes no trigram entries.
    """

    pk = models.CompositePrimaryKey("operation_id", "kind")
    # No foreign key: every key to an operation is RESTRICT (migration 0029), and these
    # rows go with their operation by trigger, whoever deletes it.
    operation = models.ForeignKey(Operation, on_delete=models.DO_NOTHING, db_constraint=False,
                                  db_index=False, related_name="+")
    kind = models.CharField(max_length=10, choices=SearchKind.choices)
    tenant = models.CharField(max_length=100)
    # Its trigram index, operation_search_text_idx, is migration 0051's (as 0032's was: a
    # GinIndex in Meta would need django.contrib.postgres installed).
    text = models.TextField()

    def __str__(self) -> str:
        return f"{self.kind} of operation {self.operation_id}: {self.text}"


# A move to safe_to_retry that no person made (a reconciler's verdict): refused when the
# operation may never be retried without a person, by its own retry policy or by the desk's
# unknown-outcome policy of its kind (ledger.outcome_policies; the policies of
# LEDGER_UNKNOWN_OUTCOME_POLICIES are the reconciler's settings, not rows, and are applied in
# Python alone).
_AUTOMATIC_RETRY_WHEN = (f"NEW.to_state = '{State.SAFE_TO_RETRY}' "
                         f"AND NEW.actor_kind <> '{ActorKind.HUMAN}'")
_AUTOMATIC_RETRY_CHECK = f"""
    SELECT o.operation, o.operation_id, o.tenant, o.retry_policy INTO op
      FROM ledger_operation o WHERE o.id = NEW.operation_id;
    IF op.retry_policy = '{RetryPolicy.NEVER}' THEN
        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',
            MESSAGE = format('operation %s: expected a person to decide a retry of an '
                             'operation whose retry policy is never, found a move to '
                             'safe_to_retry by %s %s', op.operation_id, NEW.actor_kind,
                             NEW.actor_id);
    END IF;
    SELECT p.automatic_retry INTO automatic
      FROM ledger_unknownoutcomepolicy p
     WHERE p.tenant = op.tenant
       AND {pattern_matches_sql("op.operation").replace("%%", "%")}
     ORDER BY p.pattern = op.operation DESC,
              length(replace(replace(p.pattern, '*', ''), '?', '')) DESC, p.id
     LIMIT 1;
    IF automatic IS FALSE THEN
        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',
            MESSAGE = format('operation %s (%s): expected a person to decide a retry (the '
                             'unknown-outcome policy of its kind on the desk says so), found '
                             'a move to safe_to_retry by %s %s', op.operation_id,
                             op.operation, NEW.actor_kind, NEW.actor_id);
    END IF;
    RETURN NEW;
"""

class OperationEvent(models.Model):
    """One transition of one operation. Append-only: PostgreSQL refuses UPDATE and DELETE."""

    # No index of its own: event_one_per_operation_version (operation, version) leads with
    # it. Every transition inserts an event and the sealer rewrites it once, so each index
    # less is work less on the write path (bench P7).
    operation = models.ForeignKey(Operation, on_delete=models.CASCADE, related_name="events",
                                  db_index=False)
    tenant = models.CharField(max_length=100)
    version = models.PositiveIntegerField()
    from_state = models.CharField(max_length=20, blank=True)
    to_state = models.CharField(max_length=20)
    actor_kind = models.CharField(max_length=20, choices=ActorKind.choices)
    actor_id = models.CharField(max_length=200, blank=True)
    reason = models.TextField(blank=True)
    evidence = models.JSONField(null=True, blank=True)
    fencing_token = models.BigIntegerField(null=True, blank=True)
    # The person who decided a human-only move (receipts.resolve); PostgreSQL refuses such
    # a move without it (states.human_decision_check_sql).
    decided_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT,
        related_name="+", db_index=False,  # event_decided_by_idx: the few that have one
    )
    created_at = models.DateTimeField()
    # Tamper evidence (ledger.chain): position in the tenant's chain and the link's hash,
    # both NULL until the sealer links the committed event (ledger.chain.seal), then set
    # once and never again (`event_sealed_once`).
    chain_seq = models.BigIntegerField(null=True, blank=True)
    chain_hash = models.CharField(max_length=64, null=True, blank=True)
    # What the link's hash covers besides the transition (ledger.chain): 1, events written
    # before format 2, cover the transition alone; 2 also the operation's external_id after
    # the move and the seal of the Evidence row written with it; 3 also `content`.
    chain_format = models.PositiveSmallIntegerField(default=1, db_default=1)
    external_id = models.CharField(max_length=500, blank=True, default="", db_default="")
    evidence_seal = models.JSONField(null=True, blank=True)
    # Format 3: the operation's identity and content as of this event (target, digests of
    # its intent and result, fingerprint, key, retry policy), computed by PostgreSQL from
    # the row the same statement wrote (ledger.chain_content: the trigger
    # `event_chain_columns` sets it and chain_format, whatever the writer sent).
    content = models.JSONField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["operation", "version"], name="event_one_per_operation_version"
            ),
            models.UniqueConstraint(fields=["tenant", "chain_seq"], name="event_chain_seq_unique"),
            # Who wrote it is one of four kinds, spelled exactly: each non-agent kind is held
            # to its role (ledger_event_actor_check), and no other spelling slips past both
            # that check and the fence, whoever writes it, the owner too.
            models.CheckConstraint(
                condition=models.Q(actor_kind__in=ActorKind.values),
                name="event_actor_kind_known",
                violation_error_message="expected an actor kind among agent, human, "
                                        "reconciler, system (spelled exactly)",
            ),
            models.CheckConstraint(
                condition=models.Q(chain_seq__isnull=True, chain_hash__isnull=True)
                | models.Q(chain_seq__gte=1, chain_hash__isnull=False,
                           chain_hash__regex=r"^[0-9a-f]{64}$"),
                name="event_sealed_whole",
                violation_error_message="expected an event unsealed (no chain_seq, no "
                                        "chain_hash) or sealed (seq >= 1 and a 64-hex hash)",
            ),
        ]
        indexes = [
            models.Index(fields=["created_at", "id"], name="event_time_idx"),
            models.Index(fields=["actor_id", "created_at"], name="event_actor_idx"),
            # A user's decisions (PROTECT on deleting the user); agents' events have none.
            models.Index(fields=["decided_by"], name="event_decided_by_idx",
                         condition=models.Q(decided_by__isnull=False)),
            # The sealer's work list: what is committed and not yet linked, per tenant.
            models.Index(fields=["tenant", "id"], name="event_unsealed_idx",
                         condition=models.Q(chain_seq__isnull=True)),
        ]
        ordering = ["operation", "version"]
        triggers = [
            AppendOnly(name="event_append_only", sealed=True),
            Trigger(
                name="event_sealed_once",
                operation=pgtrigger.Update,
                when=pgtrigger.Before,
                func=_EVENT_SEALED_ONCE,
            ),
            # The chain's columns are PostgreSQL's: chain_format and content set here,
            # whatever the writer sent; a link (chain_seq, chain_hash) refused.
            Trigger(
                name="event_chain_columns",
                operation=pgtrigger.Insert,
                when=pgtrigger.Before,
                declare=[("op_tenant", "text")],
                func=EVENT_CHAIN_COLUMNS_SQL,
            ),
            Trigger(
                name="event_human_decision_check",
                operation=pgtrigger.Insert,
                when=pgtrigger.Before,
                func=human_decision_check_sql(),
            ),
            TWO_PERSON_TRIGGER,
            Trigger(
                name="event_fenced",
                operation=pgtrigger.Insert,
                when=pgtrigger.Before,
                condition=pgtrigger.Condition(_EVENT_FENCED_WHEN),
                declare=[("lease", "record")],
                func=_EVENT_FENCED,
            ),
            # safe_to_retry without a person only where a retry is allowed: the operation's
            # retry policy is not `never`, and the desk's unknown-outcome policy of its
            # kind (the matching row that ranks first, as the reconciler ranks them) does
            # not say "a person decides" (automatic_retry false).
            Trigger(
                name="event_automatic_retry_check",
                operation=pgtrigger.Insert,
                when=pgtrigger.Before,
                condition=pgtrigger.Condition(_AUTOMATIC_RETRY_WHEN),
                declare=[("op", "record"), ("automatic", "boolean")],
                func=_AUTOMATIC_RETRY_CHECK,
            ),
            Trigger(
                name="event_reconciler_fenced",
                operation=pgtrigger.Insert,
                when=pgtrigger.Before,
                condition=pgtrigger.Q(new__actor_kind=ActorKind.RECONCILER),
                declare=[("lease", "record")],
                func=_EVENT_RECONCILER_FENCED,
            ),
        ]

    def __str__(self):
        return f"{self.operation_id} v{self.version}: {self.from_state or '-'} -> {self.to_state}"


class Evidence(models.Model):
    """What a reconciler asked the external system and what it saw. Append-only."""

    operation = models.ForeignKey(Operation, on_delete=models.CASCADE, related_name="evidence")
    reconciler = models.CharField(max_length=200)
    query = models.JSONField(default=dict)
    observed = models.JSONField(default=dict)
    verdict = models.CharField(max_length=40)
    matched_by = models.CharField(max_length=40, blank=True)
    detail = models.TextField(blank=True)
    created_at = models.DateTimeField()
    # Set when retention replaced query, observed and detail (ledger.retention).
    redacted_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name_plural = "evidence"
        ordering = ["operation", "created_at", "id"]
        indexes = [
            # The readings of blind verifiers, for /metrics (ledger.metrics.blind_verifiers):
            # few rows, read by time.
            models.Index(fields=["created_at"], name="evidence_verifier_blind_idx",
                         condition=models.Q(verdict="verifier_blind")),
        ]
        triggers = [
            AppendOnly(name="evidence_append_only"),
        ]

    def __str__(self):
        return f"{self.verdict} for {self.operation_id} by {self.reconciler}"
