"""The demo operations: a realistic mix, safe to seed twice, and reconcilable afterwards."""

import io

import pytest
from django.core.management import call_command

from demo.operations import seed_operations
from demo.simulated.articles import (
    ArticlesService,
    demo_articles_file,
    demo_articles_port,
    demo_articles_url,
    load_articles,
)
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

    # The running demo's reconciler reads the demo's service, which starts with what the
    # seed's agents created on it: what the seed left outcome_unknown settles by what the
    # service holds, never by a closed port.
    assert {op.target for op in Operation.objects.filter(operation="articles.create")} == {
        demo_articles_url()}
    command_out = io.StringIO()
    with ArticlesService(port=demo_articles_port(),
                         articles=load_articles(demo_articles_file())):
        call_command("reconcile", "--once", stdout=command_out)
    assert " error -> " not in command_out.getvalue(), command_out.getvalue()
    committed = ["Late edition", "Webinar next Tuesday", "April newsletter"]
    for op in Operation.objects.filter(intent__title__in=committed):
        assert op.state == State.SUCCEEDED, (op.intent["title"], op.state)
        assert op.evidence.order_by("id").last().verdict == "found"


@pytest.mark.django_db(transaction=True)
def test_a_few_seeded_items_stay_outcome_unknown_against_the_service_the_demo_runs(
        monkeypatch, settings):
    """The demo's service (Procfile.demo's `articles`) running beside the reconciler, with
    the articles the seed left it: the seeded DECIDE_BY_HAND items name it, the reconciler
    reads it (and finds the control it knows is there), and they stay outcome_unknown
    (absent, but maybe still in flight for a day) for a reviewer."""
    from datetime import timedelta

    from django.utils import timezone

    from demo.operations import DECIDE_BY_HAND
    from ledger import reconcile

    seed_operations(io.StringIO())
    by_hand = Operation.objects.filter(intent__title__in=[t for _, _, t in DECIDE_BY_HAND])
    assert by_hand.count() == len(DECIDE_BY_HAND) >= 3
    assert {op.target for op in by_hand} == {demo_articles_url()}
    with ArticlesService(port=demo_articles_port(),
                         articles=load_articles(demo_articles_file())):
        for _ in range(3):
            reconcile.run_once(worker="demo-test")
    for op in by_hand:
        op.refresh_from_db()
        assert op.state == State.OUTCOME_UNKNOWN, (op.operation_id, op.state)
        assert op.next_attempt_at > timezone.now() + timedelta(hours=12)
        evidence = op.evidence.get()
        assert evidence.verdict == "proven_absent" and "in flight" in op.events.last().reason
        assert evidence.observed["positive_control"]["status"] == "seen", evidence.observed


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


@pytest.mark.django_db
def test_the_seed_says_so_when_the_demos_articles_port_is_taken():
    import socket

    port = demo_articles_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        with pytest.raises(OSError, match=f"expected 127.0.0.1:{port} free for the demo's "
                                          "articles service while the seed writes"):
            seed_operations(io.StringIO())
    assert not Operation.objects.exists()
