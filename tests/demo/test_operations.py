"""The demo operations: a realistic mix, safe to seed twice, and reconcilable afterwards."""

import io

import pytest
from django.core.management import call_command

from demo.operations import seed_operations
from ledger.models import Evidence, Operation
from ledger.states import State


@pytest.mark.django_db(transaction=True)
def test_the_demo_leaves_a_mix_of_states_is_safe_twice_and_reconcile_once_runs_on_it():
    out = io.StringIO()
    seed_operations(out)
    states = set(Operation.objects.values_list("state", flat=True))
    assert {State.SUCCEEDED, State.SAFE_TO_RETRY, State.MANUAL_REVIEW, State.OUTCOME_UNKNOWN,
            State.REJECTED} <= states
    verdicts = set(Evidence.objects.values_list("verdict", flat=True))
    assert {"found", "proven_absent", "ambiguous", "not_yet"} <= verdicts
    twins = Operation.objects.filter(state=State.SUCCEEDED, intent__title="Weekly digest")
    assert twins.count() == 2 and len({op.intent_fingerprint for op in twins}) == 1
    assert "demo-secret" not in str(list(Operation.objects.values_list("intent", flat=True)))
    count = Operation.objects.count()

    seed_operations(out)
    assert Operation.objects.count() == count
    assert "exist already" in out.getvalue()

    command_out = io.StringIO()
    call_command("reconcile", "--once", stdout=command_out)
    assert "articles.create error -> outcome_unknown" in command_out.getvalue()
