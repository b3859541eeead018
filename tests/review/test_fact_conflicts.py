"""Fact conflicts in the desk: the list, the detail, "Use this value", and a real race."""

import threading

import pytest
from django.db import connections
from django.test import Client
from django.urls import reverse

from ledger import facts, runs
from ledger.models import Fact, FactConflict, FactDecision
from tests.factories import UserFactory, ensure_roles
from tests.review.execution_setup import make_conflict

CONFLICTS = reverse("review:conflicts")
HOSTILE = "<img src=x onerror=alert(1)>"


def detail_url(conflict):
    return reverse("review:conflict", args=[conflict.pk])


def resolve_url(conflict):
    return reverse("review:resolve_conflict", args=[conflict.pk])


def use_value(client, conflict, winner, *, reason="checked the bank statement",
              expected_version=None, **headers):
    version = conflict.current.version if expected_version is None else expected_version
    return client.post(resolve_url(conflict), {"winner": winner, "reason": reason,
                                               "expected_version": version}, **headers)


@pytest.mark.django_db
def test_the_list_shows_both_values_sources_times_subject_and_run(client, reviewer):
    run = runs.start("Reconcile invoices", run_id="run-invoices")
    conflict = make_conflict(run=run, candidate={"paid": True, "note": HOSTILE})
    client.force_login(reviewer)
    body = client.get(CONFLICTS).content.decode()
    assert "invoice:42" in body and "status" in body
    assert "billing-agent" in body and "bank-feed" in body
    assert "&quot;paid&quot;: false" in body and "&quot;paid&quot;: true" in body
    assert HOSTILE not in body and "&lt;img src=x onerror=alert(1)&gt;" in body
    assert conflict.current.observed_at.strftime("%Y-%m-%d %H:%M:%S") in body
    assert conflict.candidate.created_at.strftime("%Y-%m-%d %H:%M:%S") in body
    assert reverse("review:run", args=["run-invoices"]) in body
    assert detail_url(conflict) in body


@pytest.mark.django_db
def test_the_queue_counts_open_conflicts_and_links_their_tab(client, reviewer):
    make_conflict("invoice:1")
    make_conflict("invoice:2")
    make_conflict("invoice:3", tenant="acme")
    client.force_login(reviewer)
    body = client.get(reverse("review:queue")).content.decode()
    assert '<b data-count="fact_conflicts">2</b>' in body
    assert f'href="{CONFLICTS}"' in body


@pytest.mark.django_db
def test_a_decided_conflict_leaves_the_list_and_the_count(client, reviewer):
    kept = make_conflict("invoice:1")
    decided = make_conflict("invoice:2")
    facts.resolve_conflict(decided, winner="candidate", user=reviewer, reason="bank says so")
    client.force_login(reviewer)
    body = client.get(CONFLICTS).content.decode()
    assert detail_url(kept) in body and detail_url(decided) not in body
    assert '<b data-count="fact_conflicts">1</b>' in body


@pytest.mark.django_db
def test_another_tenants_conflicts_are_neither_listed_nor_counted(client, reviewer):
    mine = make_conflict("invoice:1")
    theirs = make_conflict("invoice:2", tenant="acme")
    client.force_login(reviewer)
    body = client.get(CONFLICTS).content.decode()
    assert detail_url(mine) in body and detail_url(theirs) not in body
    assert client.get(detail_url(theirs)).status_code == 404


@pytest.mark.django_db
def test_keyset_pages_of_conflicts_cover_each_once(client, reviewer):
    made = [make_conflict(f"invoice:{n}") for n in range(5)]
    client.force_login(reviewer)
    seen, cursor = [], ""
    while True:
        response = client.get(CONFLICTS, {"per_page": 2, "cursor": cursor})
        page = response.context["page"]
        seen += [c.pk for c in page.items]
        if not page.next_cursor:
            break
        cursor = page.next_cursor
    assert seen == [c.pk for c in made]


@pytest.mark.django_db
@pytest.mark.parametrize("per_page", [1, 50])
def test_the_conflict_list_runs_a_fixed_number_of_queries(client, reviewer, per_page,
                                                          django_assert_num_queries):
    for n in range(4):
        make_conflict(f"invoice:{n}", run=runs.start("r", run_id=f"run-{n}"))
    client.force_login(reviewer)
    # session, user, user perms, group perms, tenant grants, the page, two capped counts
    with django_assert_num_queries(8):
        response = client.get(CONFLICTS, {"per_page": per_page})
    assert len(response.context["page"].items) == min(per_page, 4)


@pytest.mark.django_db
def test_htmx_list_request_gets_only_the_results_fragment(client, reviewer):
    make_conflict()
    client.force_login(reviewer)
    body = client.get(CONFLICTS, headers={"HX-Request": "true"}).content.decode()
    assert body.lstrip().startswith('<section id="results"') and "<html" not in body


@pytest.mark.django_db
def test_detail_shows_both_sides_and_offers_use_this_value_to_a_reviewer(client, reviewer):
    run = runs.start("Reconcile invoices", run_id="run-invoices")
    conflict = make_conflict(run=run, candidate={"paid": True, "by": HOSTILE})
    client.force_login(reviewer)
    body = client.get(detail_url(conflict)).content.decode()
    assert body.count(">Use this value</button>") == 2
    assert 'name="winner" value="current"' in body and 'name="winner" value="candidate"' in body
    assert f'name="expected_version" value="{conflict.current.version}"' in body
    assert "billing-agent" in body and "bank-feed" in body and "run-invoices" in body
    assert HOSTILE not in body and "&lt;img src=x onerror=alert(1)&gt;" in body


@pytest.mark.django_db
def test_a_viewer_sees_the_conflict_but_no_buttons(client, viewer):
    conflict = make_conflict()
    client.force_login(viewer)
    body = client.get(detail_url(conflict)).content.decode()
    assert "bank-feed" in body and "Use this value" not in body and 'name="winner"' not in body
    assert "Your role cannot decide fact conflicts" in body


@pytest.mark.django_db
def test_the_detail_runs_a_fixed_number_of_queries(client, reviewer, django_assert_num_queries):
    conflict = make_conflict(run=runs.start("r", run_id="run-1"))
    client.force_login(reviewer)
    # session, user, user perms, group perms, tenant grants, the conflict with both sides,
    # the version current now
    with django_assert_num_queries(7):
        client.get(detail_url(conflict))


@pytest.mark.django_db
@pytest.mark.parametrize("winner, value", [("current", {"paid": False}),
                                           ("candidate", {"paid": True})])
def test_use_this_value_makes_it_the_next_current_version_with_the_reason(client, reviewer,
                                                                          winner, value):
    conflict = make_conflict()
    client.force_login(reviewer)
    response = use_value(client, conflict, winner, reason="bank statement of 3 March")
    assert response.status_code == 302 and response["Location"] == detail_url(conflict)
    current = facts.read_fact("invoice:42", "status")
    assert (current.version, current.value, current.source) == (2, value, "reviewer:reviewer")
    conflict.refresh_from_db()
    assert not conflict.is_open and conflict.resolution_reason == "bank statement of 3 March"
    [decision] = FactDecision.objects.filter(conflict=conflict)
    assert decision.username == "reviewer"
    page = client.get(response["Location"]).content.decode()
    assert "Recorded: used" in page and "Use this value" not in page
    assert "bank statement of 3 March" in page


@pytest.mark.django_db
def test_a_decision_without_a_reason_is_refused_and_writes_nothing(client, reviewer):
    conflict = make_conflict()
    client.force_login(reviewer)
    response = use_value(client, conflict, "candidate", reason="  ")
    assert response.status_code == 422
    assert "A reason is required" in response.content.decode()
    conflict.refresh_from_db()
    assert conflict.is_open and FactDecision.objects.count() == 0
    assert facts.read_fact("invoice:42", "status").version == 1


@pytest.mark.django_db
def test_a_second_decision_is_told_who_decided_first_and_writes_nothing(client, reviewer):
    conflict = make_conflict()
    alice = Client()
    alice.force_login(UserFactory(username="alice", role="reviewer"))
    use_value(alice, conflict, "current", reason="alice phoned billing")
    client.force_login(reviewer)
    response = use_value(client, conflict, "candidate")
    page = client.get(response["Location"]).content.decode()
    assert "Nothing recorded: alice already decided this conflict at" in page
    assert "the current value" in page and "alice phoned billing" in page
    assert FactDecision.objects.filter(conflict=conflict).count() == 1
    assert facts.read_fact("invoice:42", "status").value == {"paid": False}


@pytest.mark.django_db
def test_a_fact_that_moved_on_since_the_page_was_rendered_is_not_overwritten(client, reviewer):
    conflict = make_conflict()
    rendered_version = conflict.current.version
    facts.assert_fact("invoice:42", "status", {"paid": "partly"}, source="billing-agent",
                      expected_version=rendered_version)
    client.force_login(reviewer)
    response = use_value(client, conflict, "candidate", expected_version=rendered_version)
    page = client.get(response["Location"]).content.decode()
    assert "Nothing recorded: invoice:42 status moved on since you loaded the page" in page
    assert "version 2" in page and "partly" in page
    assert 'name="expected_version" value="2"' in page
    conflict.refresh_from_db()
    assert conflict.is_open and FactDecision.objects.count() == 0
    assert facts.read_fact("invoice:42", "status").value == {"paid": "partly"}


@pytest.mark.django_db
def test_htmx_decision_returns_the_fresh_decision_fragment(client, reviewer):
    conflict = make_conflict()
    client.force_login(reviewer)
    response = use_value(client, conflict, "candidate", headers={"HX-Request": "true"})
    body = response.content.decode()
    assert response.status_code == 200
    assert body.lstrip().startswith('<section id="decision"') and "<html" not in body
    assert "Recorded: used the candidate value" in body and 'name="winner"' not in body


@pytest.mark.django_db
def test_a_viewer_forging_a_decision_gets_403_and_nothing_changes(client, viewer):
    conflict = make_conflict()
    client.force_login(viewer)
    assert use_value(client, conflict, "candidate").status_code == 403
    conflict.refresh_from_db()
    assert conflict.is_open and Fact.objects.current().get().version == 1


@pytest.mark.django_db
def test_a_decision_runs_a_fixed_number_of_queries(client, reviewer, django_assert_num_queries):
    conflict = make_conflict()
    client.force_login(reviewer)
    # session, user, user perms, group perms, tenant grants, the conflict; the durable
    # block (a savepoint here): lock, current version, next id, supersede, insert, read
    # back, resolve the conflict, decision (written unsealed: the sealer links it);
    # release; refresh
    version = conflict.current.version
    with django_assert_num_queries(17):
        use_value(client, conflict, "candidate", expected_version=version)
    assert not FactConflict.objects.get(pk=conflict.pk).is_open


@pytest.mark.django_db(transaction=True)
def test_two_reviewers_at_once_one_decides_the_other_is_told_one_decision():
    ensure_roles()
    conflict = make_conflict()
    users = [UserFactory(username=name, role="reviewer") for name in ("alice", "bob")]
    barrier = threading.Barrier(2)
    results = {}

    def reviewer_decides(user, winner):
        try:
            client = Client()
            client.force_login(user)
            barrier.wait()
            response = use_value(client, conflict, winner, reason=f"{user.username} decided",
                                 headers={"HX-Request": "true"})
            results[user.username] = response.content.decode()
        finally:
            connections.close_all()

    threads = [threading.Thread(target=reviewer_decides, args=(users[0], "current")),
               threading.Thread(target=reviewer_decides, args=(users[1], "candidate"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    [decision] = FactDecision.objects.filter(conflict=conflict)
    winner = decision.username
    loser = "bob" if winner == "alice" else "alice"
    assert "Recorded: used" in results[winner]
    assert f"Nothing recorded: {winner} already decided this conflict at" in results[loser]
    history = facts.history("invoice:42", "status")
    assert [f.version for f in history if f.version] == [1, 2]
    assert facts.read_fact("invoice:42", "status").source == f"reviewer:{winner}"
