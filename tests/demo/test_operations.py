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


@pytest.mark.django_db(transaction=True)
def test_a_few_seeded_items_stay_outcome_unknown_against_the_service_the_demo_runs(
        monkeypatch, settings):
    """The demo's service (Procfile.demo's `articles`) running beside the reconciler: the
    seeded DECIDE_BY_HAND items name it, the reconciler reads it, and they stay
    outcome_unknown (absent, but maybe still in flight for a day) for a reviewer."""
    from datetime import timedelta

    from django.utils import timezone

    from demo.operations import DECIDE_BY_HAND
    from demo.simulated.articles import ArticlesService, demo_articles_url
    from ledger import reconcile
    from tests.support.servers import free_port

    port = free_port()
    monkeypatch.setenv("DEMO_ARTICLES_PORT", str(port))
    seed_operations(io.StringIO())
    by_hand = Operation.objects.filter(
        idempotency_key__in=[op.idempotency_key for op in Operation.objects.all()
                             if op.target == demo_articles_url()])
    assert by_hand.count() == len(DECIDE_BY_HAND) >= 3
    with ArticlesService(port=port):
        for _ in range(3):
            reconcile.run_once(worker="demo-test")
    for op in by_hand:
        op.refresh_from_db()
        assert op.state == State.OUTCOME_UNKNOWN, (op.operation_id, op.state)
        assert op.next_attempt_at > timezone.now() + timedelta(hours=12)
        evidence = op.evidence.get()
        assert evidence.verdict == "proven_absent" and "in flight" in op.events.last().reason


def test_the_demos_articles_port_follows_the_desks_port_or_its_own_variable(monkeypatch,
                                                                            settings):
    from pathlib import Path

    from demo.simulated.articles import demo_articles_port

    monkeypatch.delenv("DEMO_ARTICLES_PORT", raising=False)
    settings.LEDGER_DESK_URL = "http://127.0.0.1:8000"
    assert demo_articles_port() == 8765
    settings.LEDGER_DESK_URL = "http://127.0.0.1:9000"
    assert demo_articles_port() == 9765
    monkeypatch.setenv("DEMO_ARTICLES_PORT", "9999")
    assert demo_articles_port() == 9999
    procfile = (Path(__file__).resolve().parents[2] / "Procfile.demo").read_text()
    assert "8765" not in procfile and "manage.py demo_articles\n" in procfile
