"""Random sequences of receipt, fact and obligation calls, with invariants after each.

A Hypothesis state machine drives the public API (and `transitions._apply`, the one writer)
against real PostgreSQL, keeps a small model of what must be true, and checks after every
step: one current fact per key, versions step by one along `superseded_by`, committed
obligations never change, and every operation transition is legal and evidenced by exactly
one event (including the database's own deferred check).
"""

from collections import defaultdict

import pytest
from django.contrib.auth.models import User
from django.db import connection, transaction
from django.db.models import Count
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from ledger import facts, obligations, receipts, runs, states, transitions
from ledger.errors import AlreadyCommitted, IllegalTransition, InvalidInput, StaleFact
from ledger.models import Fact, FactConflict, FactStatus, Obligation, Operation
from ledger.states import ActorKind, State
from tests.factories import UserFactory, reconciler_lease

SUBJECTS = st.sampled_from(["order:1", "order:2"])
PREDICATES = st.sampled_from(["status", "carrier"])
VALUES = st.sampled_from(["a", "b", "c"])
SOURCES = st.sampled_from(["agent-a", "agent-b"])
OBLIGATION_KEYS = st.sampled_from(["ob-1", "ob-2", "ob-3"])
INDEX = st.integers(min_value=0, max_value=50)

AGENT_CALLS = {
    State.SUBMITTED: lambda op: receipts.mark_submitted(op),
    State.SUCCEEDED: lambda op: receipts.mark_succeeded(op, external_id="ext-1"),
    State.REJECTED: lambda op: receipts.mark_rejected(op, error_code="E422"),
    State.OUTCOME_UNKNOWN: lambda op: receipts.mark_outcome_unknown(op, error_code="timeout"),
}
RECONCILER_TARGETS = [State.RECONCILING, State.SUCCEEDED, State.SAFE_TO_RETRY,
                      State.MANUAL_REVIEW, State.OUTCOME_UNKNOWN]


class ExecutionMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        # Each example runs in its own savepoint, rolled back at teardown.
        self.savepoint = transaction.savepoint_create()
        self.run = runs.start("stateful run", run_id="run-stateful")
        self.reviewer = User.objects.get(username="sm-reviewer")
        self.ops: list[Operation] = []
        self.op_states: dict[int, str] = {}
        self.fact_model: dict[tuple[str, str], tuple[int, str]] = {}
        self.candidates: set[tuple[str, str, int, str, str]] = set()
        self.resolved = 0
        self.obligation_states: dict[str, str] = {}
        self.committed: dict[str, tuple[object, object]] = {}

    def teardown(self):
        transaction.savepoint_rollback(self.savepoint)

    # --- receipts ----------------------------------------------------------------------

    @initialize()
    def two_receipts(self):
        self.record_intent()
        self.record_intent()

    @precondition(lambda self: len(self.ops) < 3)
    @rule()
    def record_intent(self):
        op = receipts.record_intent("stateful.op", "t", {"n": len(self.ops)}, run=self.run,
                                    idempotency_key=f"sm-{len(self.ops)}")
        self.ops.append(op)
        self.op_states[op.pk] = State.PLANNED

    @precondition(lambda self: self.ops)
    @rule(index=INDEX, target_state=st.sampled_from(sorted(AGENT_CALLS)))
    def agent_reports(self, index, target_state):
        op = self.ops[index % len(self.ops)]
        from_state = op.state
        allowed = (states.is_legal(from_state, target_state)
                   and (from_state, target_state) not in states.HUMAN_ONLY)
        self._expect(allowed, op, target_state, lambda: AGENT_CALLS[target_state](op))

    @precondition(lambda self: self.ops)
    @rule(index=INDEX, target_state=st.sampled_from(RECONCILER_TARGETS))
    def reconciler_moves(self, index, target_state):
        op = self.ops[index % len(self.ops)]
        if (op.state, target_state) in states.HUMAN_ONLY:
            return  # the reconciler never takes a person's decision

        def move():
            with transaction.atomic():
                transitions._apply(op, target_state, actor_kind=ActorKind.RECONCILER,
                                   fencing_token=reconciler_lease(op),
                                   actor_id="stateful", reason="stateful")

        self._expect(states.is_legal(op.state, target_state), op, target_state, move)

    @precondition(lambda self: self.ops)
    @rule(index=INDEX, target_state=st.sampled_from(states.RESOLUTIONS))
    def person_resolves(self, index, target_state):
        op = self.ops[index % len(self.ops)]
        allowed = (op.state, target_state) in states.HUMAN_ONLY
        self._expect(allowed, op, target_state, lambda: receipts.resolve(
            op, target_state, user=self.reviewer, reason="checked by hand"))

    @precondition(lambda self: self.ops)
    @rule(index=INDEX, choices=st.lists(INDEX, min_size=1, max_size=6))
    def someone_takes_legal_steps(self, index, choices):
        """Walk deeper than random targets would: up to six legal next states, each taken
        by whoever may take it (a person, the agent, the reconciler)."""
        op = self.ops[index % len(self.ops)]
        for choice in choices:
            # Non-terminal states first, so that small choices walk deep.
            targets = sorted(states.targets(op.state), key=lambda t: (t in states.TERMINAL, t))
            if not targets:
                return
            target_state = targets[choice % len(targets)]
            if (op.state, target_state) in states.HUMAN_ONLY:
                receipts.resolve(op, target_state, user=self.reviewer, reason="by hand")
            elif target_state in AGENT_CALLS and op.state != State.RECONCILING:
                AGENT_CALLS[target_state](op)
            else:
                with transaction.atomic():
                    transitions._apply(op, target_state,
                                       actor_kind=ActorKind.RECONCILER,
                                       fencing_token=reconciler_lease(op),
                                       actor_id="stateful", reason="stateful")
            self.op_states[op.pk] = target_state

    def _expect(self, allowed, op, target_state, call):
        if allowed:
            call()
            self.op_states[op.pk] = target_state
        else:
            with pytest.raises(IllegalTransition):
                call()

    # --- facts -------------------------------------------------------------------------

    @rule(subject=SUBJECTS, predicate=PREDICATES, value=VALUES, source=SOURCES,
          version=st.one_of(st.just("current"), st.none(), st.integers(1, 4)))
    def assert_fact(self, subject, predicate, value, source, version):
        key = (subject, predicate)
        current = self.fact_model.get(key)
        expected_version = (current[0] if current else None) if version == "current" else version
        call = lambda: facts.assert_fact(subject, predicate, value, source=source,  # noqa: E731
                                         expected_version=expected_version, run=self.run)
        if current is None:
            if expected_version is not None:
                with pytest.raises(StaleFact):
                    call()
                return
            assert call().version == 1
            self.fact_model[key] = (1, value)
            return
        fact = call()
        if value == current[1]:
            assert fact.is_current and fact.version == current[0]
        elif expected_version == current[0]:
            assert fact.is_current and fact.version == current[0] + 1
            self.fact_model[key] = (current[0] + 1, value)
        else:
            assert fact.is_candidate and fact.conflict.current.version == current[0]
            self.candidates.add((subject, predicate, current[0], value, source))

    @precondition(lambda self: len(self.candidates) > self.resolved)
    @rule(index=INDEX, side=st.sampled_from(["current", "candidate"]),
          name_the_version=st.booleans())
    def person_decides_a_conflict(self, index, side, name_the_version):
        conflicts = list(FactConflict.objects.open().select_related("current", "candidate")
                         .order_by("id"))
        conflict = conflicts[index % len(conflicts)]
        key = (conflict.subject, conflict.predicate)
        live_version = self.fact_model[key][0]
        expected_version = live_version if name_the_version else None
        call = lambda: facts.resolve_conflict(  # noqa: E731
            conflict, winner=side, user=self.reviewer, reason="decided",
            expected_version=expected_version)
        if expected_version is None and conflict.current.version != live_version:
            with pytest.raises(StaleFact):
                call()
            return
        written = call()
        chosen = conflict.current if side == "current" else conflict.candidate
        assert (written.version, written.value) == (live_version + 1, chosen.value)
        self.fact_model[key] = (live_version + 1, chosen.value)
        self.resolved += 1

    # --- obligations -------------------------------------------------------------------

    @rule(key=OBLIGATION_KEYS)
    def open_obligation(self, key):
        obligation = obligations.open(self.run, "stateful.kind", key)
        self.obligation_states.setdefault(key, "open")
        assert obligation.state == self.obligation_states[key]

    @rule(key=OBLIGATION_KEYS, result=st.integers(0, 3))
    def commit_obligation(self, key, result):
        state = self.obligation_states.get(key)
        if state is None:
            with pytest.raises(InvalidInput):
                obligations.commit(key, result)
        elif state == "committed":
            with pytest.raises(AlreadyCommitted) as info:
                obligations.commit(key, result)
            assert info.value.result == self.committed[key][0]
        elif state == "cancelled":
            with pytest.raises(IllegalTransition):
                obligations.commit(key, result)
        else:
            committed = obligations.commit(key, {"result": result})
            self.obligation_states[key] = "committed"
            self.committed[key] = (committed.result, committed.committed_at)

    @rule(key=OBLIGATION_KEYS)
    def cancel_obligation(self, key):
        state = self.obligation_states.get(key)
        if state is None:
            with pytest.raises(InvalidInput):
                obligations.cancel(key, reason="not needed")
        elif state == "committed":
            with pytest.raises(AlreadyCommitted):
                obligations.cancel(key, reason="not needed")
        else:
            assert obligations.cancel(key, reason="not needed").state == "cancelled"
            self.obligation_states[key] = "cancelled"

    # --- invariants --------------------------------------------------------------------

    @invariant()
    def every_transition_is_legal_and_evidenced_by_exactly_one_event(self):
        for op in Operation.objects.filter(run=self.run).prefetch_related("events"):
            events = sorted(op.events.all(), key=lambda e: e.version)
            assert [e.version for e in events] == list(range(1, op.version + 1))
            assert (events[0].from_state, events[0].to_state) == ("", State.PLANNED)
            for before, after in zip(events, events[1:], strict=False):
                assert after.from_state == before.to_state
                assert states.is_legal(after.from_state, after.to_state)
            assert events[-1].to_state == op.state == self.op_states[op.pk]
        # The database's own check (deferred to commit) must hold at every step too.
        with connection.cursor() as cursor:
            cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
            cursor.execute("SET CONSTRAINTS ALL DEFERRED")

    @invariant()
    def one_current_fact_per_key(self):
        doubled = (Fact.objects.current().values("tenant", "subject", "predicate")
                   .annotate(n=Count("id")).filter(n__gt=1))
        assert list(doubled) == []

    @invariant()
    def fact_versions_step_by_one_and_match_the_model(self):
        chains = defaultdict(list)
        for fact in Fact.objects.exclude(status=FactStatus.CANDIDATE).order_by("version"):
            chains[(fact.subject, fact.predicate)].append(fact)
        assert set(chains) == set(self.fact_model)
        for key, chain in chains.items():
            assert [f.version for f in chain] == list(range(1, len(chain) + 1))
            for older, newer in zip(chain, chain[1:], strict=False):
                assert (older.status, older.superseded_by_id) == ("superseded", newer.pk)
            assert chain[-1].is_current and chain[-1].superseded_by_id is None
            assert (chain[-1].version, chain[-1].value) == self.fact_model[key]
        assert FactConflict.objects.count() == len(self.candidates)
        assert FactConflict.objects.filter(state="resolved").count() == self.resolved

    @invariant()
    def committed_obligations_never_change(self):
        stored = {o.key: o for o in Obligation.objects.all()}
        assert {k: o.state for k, o in stored.items()} == self.obligation_states
        for key, (result, committed_at) in self.committed.items():
            assert (stored[key].result, stored[key].committed_at) == (result, committed_at)


@pytest.mark.django_db
def test_random_sequences_of_receipts_facts_and_obligations_keep_every_invariant():
    UserFactory(username="sm-reviewer", role="reviewer")  # shared by every example
    run_state_machine_as_test(
        ExecutionMachine,
        settings=settings(max_examples=25, stateful_step_count=20, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow],
                          database=None),
    )
