"""The operation state machine: the one table of legal transitions.

Two declarations are the source: `TRANSITIONS` (what may follow each state) and
`HUMAN_DECISIONS` (which of those moves only a person may make, in the order the desk
offers them). Everything else is derived from them below: the human-only pairs, the
terminal states, the states the review desk waits on a person for, the decisions a reviewer
may take, the PostgreSQL trigger on `ledger_operation` (`transition_check_sql`, installed
by a migration), the desk's actions and the queue's tabs. To change what may follow a
state, edit these two tables (and run `makemigrations` for the trigger); never write a
second copy of them.
"""

from django.core.exceptions import ImproperlyConfigured
from django.db import models


class State(models.TextChoices):
    PLANNED = "planned", "Planned"
    SUBMITTED = "submitted", "Submitted"
    SUCCEEDED = "succeeded", "Succeeded"
    REJECTED = "rejected", "Rejected"
    OUTCOME_UNKNOWN = "outcome_unknown", "Outcome unknown"
    RECONCILING = "reconciling", "Reconciling"
    SAFE_TO_RETRY = "safe_to_retry", "Safe to retry"
    MANUAL_REVIEW = "manual_review", "Manual review"
    ABANDONED = "abandoned", "Abandoned"


class RetryPolicy(models.TextChoices):
    NEVER = "never", "Never"
    IF_ABSENT_PROVEN = "if_absent_proven", "If absence is proven"


class ActorKind(models.TextChoices):
    AGENT = "agent", "Agent"
    RECONCILER = "reconciler", "Reconciler"
    HUMAN = "human", "Human"
    SYSTEM = "system", "System"


S = State

# from-state -> the states it may move to.
TRANSITIONS: dict[str, frozenset[str]] = {
    S.PLANNED: frozenset({S.SUBMITTED, S.ABANDONED}),
    S.SUBMITTED: frozenset({S.SUCCEEDED, S.REJECTED, S.OUTCOME_UNKNOWN}),
    S.OUTCOME_UNKNOWN: frozenset({S.RECONCILING, S.SUCCEEDED, S.SAFE_TO_RETRY, S.ABANDONED}),
    S.RECONCILING: frozenset(
        {S.SUCCEEDED, S.SAFE_TO_RETRY, S.MANUAL_REVIEW, S.OUTCOME_UNKNOWN}
    ),
    S.MANUAL_REVIEW: frozenset({S.SUCCEEDED, S.SAFE_TO_RETRY, S.ABANDONED}),
    S.SAFE_TO_RETRY: frozenset({S.SUBMITTED, S.ABANDONED}),
    S.SUCCEEDED: frozenset(),
    S.REJECTED: frozenset(),
    S.ABANDONED: frozenset(),
}

# from-state -> the moves out of it that only a person may make (`receipts.resolve`), in
# the order the review desk offers them. Each is also a move of TRANSITIONS.
HUMAN_DECISIONS: dict[str, tuple[str, ...]] = {
    S.OUTCOME_UNKNOWN: (S.SUCCEEDED, S.SAFE_TO_RETRY, S.ABANDONED),
    S.MANUAL_REVIEW: (S.SUCCEEDED, S.SAFE_TO_RETRY, S.ABANDONED),
}


# --- derived: never edit these, edit the two tables above ---------------------------------

# Transitions only a person may make.
HUMAN_ONLY: frozenset[tuple[str, str]] = frozenset(
    (from_state, to_state)
    for from_state, decisions in HUMAN_DECISIONS.items()
    for to_state in decisions
)
TERMINAL: frozenset[str] = frozenset(s for s, targets in TRANSITIONS.items() if not targets)
# What the review desk waits on a person for, in the order its queue shows them.
QUEUE_STATES: tuple[str, ...] = tuple(HUMAN_DECISIONS)
NEEDS_REVIEW: frozenset[str] = frozenset(QUEUE_STATES)
# The queue states a reconciler still works on (it may take them to reconciling): a person
# is told of them only after a grace (ledger.notifications); the others at once.
RECONCILABLE: frozenset[str] = frozenset(
    s for s in QUEUE_STATES if S.RECONCILING in TRANSITIONS[s]
)
# The states a call may be sent from (they may move to submitted).
SENDABLE: frozenset[str] = frozenset(s for s, to in TRANSITIONS.items() if S.SUBMITTED in to)
# What an agent records of its own call (`receipts.mark_*`): sending it, and how a sent
# call can end; in declaration order.
AGENT_OUTCOMES: tuple[str, ...] = tuple(
    s for s in State.values if s == S.SUBMITTED or s in TRANSITIONS[S.SUBMITTED]
)
# The decisions a reviewer may take, in the order the desk offers them.
RESOLUTIONS: tuple[str, ...] = tuple(
    dict.fromkeys(to_state for decisions in HUMAN_DECISIONS.values() for to_state in decisions)
)


def _check_tables() -> None:
    """Refuse, at import, tables that contradict each other: a misprint here would
    otherwise surface as a trigger that disagrees with the desk."""
    known = set(State.values)
    if set(TRANSITIONS) != known:
        raise ImproperlyConfigured(
            f"expected TRANSITIONS to have a row for every state {sorted(known)}, found rows "
            f"for {sorted(map(str, TRANSITIONS))}"
        )
    for from_state, decisions in HUMAN_DECISIONS.items():
        illegal = [str(to) for to in decisions if to not in TRANSITIONS.get(from_state, ())]
        if illegal:
            raise ImproperlyConfigured(
                f"expected every human decision from {from_state} to be a transition of "
                f"TRANSITIONS, found {illegal} which TRANSITIONS does not allow"
            )


_check_tables()


def is_legal(from_state: str, to_state: str) -> bool:
    return to_state in TRANSITIONS.get(from_state, frozenset())


def targets(from_state: str) -> list[str]:
    """The states `from_state` may move to, sorted, for messages and menus."""
    return sorted(TRANSITIONS.get(from_state, frozenset()))


def listed(values, *, empty: str = "none") -> str:
    """States as plain words for a message: "abandoned, reconciling" (sorted unless a
    list or tuple gives the order), never their Python names ("State.ABANDONED")."""
    words = [str(getattr(v, "value", v)) for v in values]
    if not isinstance(values, (list, tuple)):
        words.sort()
    return ", ".join(words) or empty


def resolutions_from(from_state: str) -> list[str]:
    """The decisions a person may take on an operation in `from_state`, in desk order."""
    return [to for to in RESOLUTIONS if (from_state, to) in HUMAN_ONLY]


def is_human_only(from_state: str, to_state: str) -> bool:
    return (from_state, to_state) in HUMAN_ONLY


def mover(from_state: str, to_state: str) -> str:
    """Who makes a legal move: "person" (a decision on the desk, or a denied approval),
    "reconciler" (into and out of reconciling) or "agent" (the sender)."""
    if is_human_only(from_state, to_state) or (from_state, to_state) == (S.PLANNED,
                                                                         S.ABANDONED):
        return "person"
    if S.RECONCILING in (from_state, to_state):
        return "reconciler"
    return "agent"


def next_moves(from_state: str) -> list[dict[str, str]]:
    """The legal moves out of `from_state` and who makes each, sorted by state: what a
    worker taking over an operation may do, or wait for."""
    return [{"to": str(to), "by": mover(from_state, to)} for to in targets(from_state)]


def _sql_literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def transition_check_sql() -> str:
    """PL/pgSQL body of the BEFORE UPDATE trigger on ledger_operation.

    Refuses a state change the table does not allow, a state change whose version does not
    step by exactly one, a version change without a state change (but for the one step of
    a terminal operation whose conflict flag or re-read schedule changes:
    `transitions.flag_by_person`, `reread_by_reconciler`), and changes to the receipt's
    identity columns; except an approver's edit of a planned intent: a new fingerprint
    with a version step.
    """
    pairs = ", ".join(
        f"({_sql_literal(a)}, {_sql_literal(b)})"
        for a, bs in sorted(TRANSITIONS.items())
        for b in sorted(bs)
    )
    terminal = ", ".join(_sql_literal(state) for state in sorted(TERMINAL))
    # An approver's edit of a planned intent (ledger.approvals.approve(intent=)): the one
    # change of the fingerprint, a version step without a state change; the approval trigger
    # (ledger.models.approval_gate) checks a person approved exactly that intent.
    edit = (f"(OLD.state = {_sql_literal(State.PLANNED)} AND NEW.state = OLD.state "
            "AND NEW.version = OLD.version + 1 "
            "AND NEW.intent_fingerprint IS DISTINCT FROM OLD.intent_fingerprint)")
    expected = " ".join(
        f"WHEN {_sql_literal(a)} THEN {_sql_literal(', '.join(targets(a)) or 'none (terminal)')}"
        for a in sorted(TRANSITIONS)
    )
    return f"""
    IF NEW.operation_id IS DISTINCT FROM OLD.operation_id
       OR NEW.tenant IS DISTINCT FROM OLD.tenant
       OR NEW.operation IS DISTINCT FROM OLD.operation
       OR NEW.idempotency_key IS DISTINCT FROM OLD.idempotency_key
       OR (NEW.intent_fingerprint IS DISTINCT FROM OLD.intent_fingerprint AND NOT {edit})
       OR (NEW.intent IS DISTINCT FROM OLD.intent AND NOT {edit}
           AND NOT ledger_sanctioned(TG_RELID))
       OR NEW.created_at IS DISTINCT FROM OLD.created_at THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('operation %s: expected its identity (operation_id, tenant, '
                             'operation, idempotency_key, intent and its fingerprint, '
                             'created_at) to stay unchanged (an intent changes only by an '
                             'approver''s edit or the retention redaction), found an UPDATE '
                             'changing it', OLD.operation_id);
    END IF;
    IF NEW.state IS DISTINCT FROM OLD.state THEN
        IF (OLD.state, NEW.state) NOT IN ({pairs}) THEN
            RAISE EXCEPTION USING ERRCODE = 'check_violation',
                MESSAGE = format('illegal transition of operation %s: expected %s -> one of '
                                 '[%s], found %s -> %s', OLD.operation_id, OLD.state,
                                 CASE OLD.state {expected} ELSE 'none (unknown state)' END,
                                 OLD.state, NEW.state);
        END IF;
        IF NEW.version IS DISTINCT FROM OLD.version + 1 THEN
            RAISE EXCEPTION USING ERRCODE = 'check_violation',
                MESSAGE = format('operation %s: expected version %s with the change %s -> %s, '
                                 'found version %s', OLD.operation_id, OLD.version + 1,
                                 OLD.state, NEW.state, NEW.version);
        END IF;
    ELSIF NEW.version IS DISTINCT FROM OLD.version AND NOT {edit}
          AND NOT (NEW.version = OLD.version + 1 AND OLD.state IN ({terminal})
                   AND (NEW.conflict IS DISTINCT FROM OLD.conflict
                        OR NEW.reread_due_at IS DISTINCT FROM OLD.reread_due_at)) THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('operation %s: expected version %s unchanged without a state '
                             'change (a terminal operation steps it by one when its conflict '
                             'flag or re-read schedule changes), found %s', OLD.operation_id,
                             OLD.version, NEW.version);
    END IF;
    RETURN NEW;
    """


def human_decision_check_sql() -> str:
    """PL/pgSQL body of the BEFORE INSERT trigger on ledger_operationevent.

    Refuses the event of a human-only move (`HUMAN_ONLY`) unless it is a person's: actor
    kind human and the deciding user (`decided_by`) named. With the deferred check that
    every state change carries its event, no UPDATE makes a human decision without one.
    """
    pairs = ", ".join(
        f"({_sql_literal(a)}, {_sql_literal(b)})" for a, b in sorted(HUMAN_ONLY)
    )
    return f"""
    IF (NEW.from_state, NEW.to_state) IN ({pairs})
       AND (NEW.actor_kind IS DISTINCT FROM {_sql_literal(ActorKind.HUMAN)}
            OR NEW.decided_by_id IS NULL) THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('operation event %s -> %s: expected a person''s decision '
                             '(actor kind human, the deciding user in decided_by), found '
                             'actor kind %s %s with decided_by %s; only receipts.resolve '
                             'makes it', NEW.from_state, NEW.to_state, NEW.actor_kind,
                             NEW.actor_id, COALESCE(NEW.decided_by_id::text, 'null'));
    END IF;
    RETURN NEW;
    """
