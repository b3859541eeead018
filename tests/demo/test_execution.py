"""The execution demo data: runs, a conflict and an overdue obligation, safe to seed twice."""

import io

import pytest

from demo.execution import seed_execution
from ledger import facts, obligations, runs
from ledger.models import Episode, Fact, FactConflict, Obligation, Operation, Run, Step


def counts():
    return [m.objects.count() for m in (Run, Step, Fact, FactConflict, Obligation, Episode,
                                        Operation)]


@pytest.mark.django_db
def test_the_demo_seeds_runs_a_fact_conflict_and_an_overdue_obligation_and_is_safe_twice():
    out = io.StringIO()
    seed_execution(out)
    first = counts()
    seed_execution(out)
    assert counts() == first
    assert "2 open fact conflict(s), 2 overdue obligation(s)" in out.getvalue()
    assert [c.subject for c in facts.open_conflicts(tenants={"default"})] == ["order:1042"]
    assert [o.key for o in obligations.overdue(tenants={"acme"})] == ["demo-acme-import-77"]
    view = runs.hand_off("demo-ship-order-1042")
    assert [(s.step_id, s.state) for s in view.steps] == [
        ("charge-card", "committed"), ("reserve-stock", "committed"), ("ship", "started"),
        ("email-customer", "pending")]
    assert [op.state for op in view.open_operations] == ["submitted"]
    assert [f.version for f in facts.history("order:1042", "status")] == [1, 2]
