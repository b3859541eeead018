"""The site's execution example runs as written, twice, with the output it promises."""

import pytest

from ledger.models import Fact, FactConflict, Obligation
from tests.support.processes import spawn
from tests.test_readme import doc_block


@pytest.mark.django_db(transaction=True)
def test_the_execution_example_on_the_site_runs_twice_and_refuses_to_overwrite():
    code = doc_block("docs/execution.md", "# Execution state: facts, obligations, runs")
    outputs = []
    for _ in range(2):
        child = spawn(code)
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        outputs.append(out)
    first, second = outputs
    for line in ("cannot ship yet, waiting for ('charge-card',)", "status paid current 1",
                 "stale: now shipped version 2", "kept for review: candidate conflict open",
                 "worker-b must wait: worker-a holds the run",
                 "[('charge-card', 'committed'), ('ship', 'started')]",
                 "[('status', 'shipped', 2, 'warehouse')]", "the old token is refused"):
        assert line in first
    assert "already sent" not in first and "cannot ship yet" not in second
    assert "status paid candidate None" in second
    assert "already sent: {'message_id': 'm-1'}" in second
    assert "stale: now shipped version 2" in second
    assert Fact.objects.filter(status="current").count() == 1
    assert FactConflict.objects.count() == 2  # "lost" once, and "paid" on the second run
    assert Obligation.objects.get().result == {"message_id": "m-1"}
