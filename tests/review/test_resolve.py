"""Decisions: each action, a required reason, version checks, htmx, and a real race."""

import threading

import pytest
from django.db import connections
from django.test import Client
from django.urls import reverse

from ledger.models import Operation, OperationEvent
from ledger.states import ActorKind, State
from review.templatetags.desk import operation_url
from tests.factories import OperationFactory, UserFactory, ensure_roles


def resolve_url(op):
    return reverse("review:resolve", args=[op.operation_id])


def decide(client, op, to_state, *, reason="checked the CMS", version=None, **extra):
    data = {"to_state": to_state, "reason": reason,
            "version": op.version if version is None else version, **extra}
    return client.post(resolve_url(op), data)


def human_events(op):
    return list(OperationEvent.objects.filter(operation=op, actor_kind=ActorKind.HUMAN))


@pytest.mark.django_db
@pytest.mark.parametrize("to_state", [State.SUCCEEDED, State.SAFE_TO_RETRY, State.ABANDONED])
def test_each_decision_is_recorded_with_its_reason_then_redirects(client, reviewer, to_state):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    client.force_login(reviewer)
    response = decide(client, op, to_state, reason="seen in the CMS")
    assert response.status_code == 302 and response["Location"] == operation_url(op)
    op.refresh_from_db()
    assert op.state == to_state
    [event] = human_events(op)
    assert (event.actor_id, event.reason, event.to_state) == ("reviewer", "seen in the CMS",
                                                             to_state)
    page = client.get(response["Location"]).content.decode()
    assert "Recorded:" in page


@pytest.mark.django_db
def test_mark_succeeded_stores_the_optional_external_id(client, reviewer):
    op = OperationFactory(state=State.MANUAL_REVIEW)
    client.force_login(reviewer)
    decide(client, op, State.SUCCEEDED, external_id="article-55")
    op.refresh_from_db()
    assert (op.state, op.external_id) == (State.SUCCEEDED, "article-55")


@pytest.mark.django_db
def test_a_decision_without_a_reason_is_refused_and_writes_nothing(client, reviewer):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    client.force_login(reviewer)
    response = decide(client, op, State.ABANDONED, reason="   ")
    assert response.status_code == 422
    assert "A reason is required" in response.content.decode()
    op.refresh_from_db()
    assert op.state == State.OUTCOME_UNKNOWN and human_events(op) == []


@pytest.mark.django_db
def test_a_stale_form_is_told_who_decided_first_and_nothing_is_written_twice(client, reviewer):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    rendered_version = op.version
    first = Client()
    first.force_login(UserFactory(username="alice", role="reviewer"))
    decide(first, op, State.SUCCEEDED, reason="alice found it", version=rendered_version)
    client.force_login(reviewer)
    response = decide(client, op, State.ABANDONED, reason="my own check",
                      version=rendered_version)
    # Re-rendered, not redirected: what the reviewer typed is still in the form.
    assert response.status_code == 409
    page = response.content.decode()
    assert "Nothing recorded: alice (human) already moved this operation" in page
    assert "alice found it" in page
    assert 'id="reconfirm"' not in page  # succeeded: no decision is open any more
    assert "Your reason, not recorded: “my own check”" in page  # and no form to keep it
    op.refresh_from_db()
    assert op.state == State.SUCCEEDED and len(human_events(op)) == 1


@pytest.mark.django_db
def test_a_decision_still_open_after_other_moves_is_offered_again_with_the_reason(
        client, reviewer):
    """The reconciler looked meanwhile (outcome_unknown -> reconciling -> outcome_unknown):
    nothing is applied, the decision is offered again on the new version, reason kept."""
    from ledger import reconcile

    op = OperationFactory(state=State.OUTCOME_UNKNOWN, operation="nobody.reconciles.this")
    seen = op.version
    claimed = reconcile.claim_next(worker="reconcile-test")
    assert claimed.operation.pk == op.pk
    reconcile.settle(claimed, reconcile.Outcome(verdict=reconcile.ERROR, reconciler="t",
                                                query={}, observed={}, detail="flaky"))
    op.refresh_from_db()
    assert (op.state, op.version) == (State.OUTCOME_UNKNOWN, seen + 2)
    client.force_login(reviewer)
    response = client.post(resolve_url(op), {"to_state": State.ABANDONED, "version": seen,
                                              "reason": "never created: checked the CMS"},
                           headers={"HX-Request": "true"})
    assert response.status_code == 409
    body = response.content.decode()
    assert 'id="reconfirm"' in body and "reconcile-test (reconciler) already moved" in body
    assert ">never created: checked the CMS</textarea>" in body
    assert f'<input type="hidden" name="version" value="{seen + 2}">' in body
    assert 'value="abandoned" class="btn btn-abandoned" data-confirm' in body
    op.refresh_from_db()
    assert op.state == State.OUTCOME_UNKNOWN and human_events(op) == []
    # The one key: the same decision, on the version now shown.
    decide(client, op, State.ABANDONED, reason="never created: checked the CMS")
    op.refresh_from_db()
    assert op.state == State.ABANDONED
    assert human_events(op)[0].reason == "never created: checked the CMS"


@pytest.mark.django_db
def test_htmx_decision_returns_the_fresh_decision_fragment(client, reviewer):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    client.force_login(reviewer)
    response = client.post(resolve_url(op), {"to_state": State.ABANDONED, "reason": "dead",
                                              "version": op.version},
                           headers={"HX-Request": "true"})
    body = response.content.decode()
    assert response.status_code == 200
    assert body.lstrip().startswith('<section id="decision"') and "<html" not in body
    assert "Recorded: Abandon" in body and 'name="to_state"' not in body
    assert "badge-abandoned" in body


@pytest.mark.django_db
def test_htmx_decision_without_reason_swaps_in_the_error(client, reviewer):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    client.force_login(reviewer)
    response = client.post(resolve_url(op), {"to_state": State.ABANDONED, "reason": "",
                                              "version": op.version},
                           headers={"HX-Request": "true"})
    assert response.status_code == 422
    assert "A reason is required" in response.content.decode()


@pytest.mark.django_db
def test_viewer_forging_a_decision_gets_403_and_nothing_changes(client, viewer):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    client.force_login(viewer)
    assert decide(client, op, State.SUCCEEDED).status_code == 403
    op.refresh_from_db()
    assert op.state == State.OUTCOME_UNKNOWN


@pytest.mark.django_db
def test_reviewer_cannot_override_a_never_retry_policy_but_an_admin_can(client, reviewer,
                                                                        admin_user):
    op = OperationFactory(state=State.MANUAL_REVIEW, retry_policy="never")
    client.force_login(reviewer)
    assert decide(client, op, State.SAFE_TO_RETRY).status_code == 403
    op.refresh_from_db()
    assert op.state == State.MANUAL_REVIEW
    client.force_login(admin_user)
    assert decide(client, op, State.SAFE_TO_RETRY).status_code == 302
    op.refresh_from_db()
    assert op.state == State.MANUAL_REVIEW  # proposed: safe_to_retry on `never` takes two
    client.force_login(UserFactory(username="admin2", role="admin"))
    assert decide(client, op, State.SAFE_TO_RETRY).status_code == 302
    op.refresh_from_db()
    assert op.state == State.SAFE_TO_RETRY


@pytest.mark.django_db
def test_deciding_on_a_settled_operation_says_so(client, reviewer):
    op = OperationFactory(state=State.SUCCEEDED)
    client.force_login(reviewer)
    response = decide(client, op, State.ABANDONED, reason="typed before it settled")
    assert response.status_code == 409
    page = response.content.decode()
    assert "Nothing recorded: expected operation" in page
    op.refresh_from_db()
    assert op.state == State.SUCCEEDED


@pytest.mark.django_db
def test_get_on_the_resolve_url_changes_nothing(client, reviewer):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    client.force_login(reviewer)
    assert client.get(resolve_url(op), {"to_state": "abandoned", "reason": "x",
                                        "version": op.version}).status_code == 405
    op.refresh_from_db()
    assert op.state == State.OUTCOME_UNKNOWN


@pytest.mark.django_db
def test_csrf_is_required_for_a_decision(reviewer):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    client = Client(enforce_csrf_checks=True)
    client.force_login(reviewer)
    assert decide(client, op, State.ABANDONED).status_code == 403
    op.refresh_from_db()
    assert op.state == State.OUTCOME_UNKNOWN


@pytest.mark.django_db
def test_a_decision_runs_a_fixed_number_of_queries(client, reviewer, django_assert_num_queries):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    client.force_login(reviewer)
    # session, user, user perms, group perms, tenant grants, operation, whether it takes
    # two people (the consequential policies); then the durable block (a savepoint inside
    # the test's transaction) holding one statement: the compare-and-set, its chain link
    # and its event
    with django_assert_num_queries(10):
        decide(client, op, State.ABANDONED)


@pytest.mark.django_db(transaction=True)
def test_two_reviewers_at_once_one_wins_the_other_is_told_one_event():
    ensure_roles()
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    users = [UserFactory(username=name, role="reviewer") for name in ("alice", "bob")]
    version = op.version
    barrier = threading.Barrier(2)
    results = {}

    def reviewer_decides(user, to_state):
        try:
            client = Client()
            client.force_login(user)
            barrier.wait()
            response = client.post(resolve_url(op), {"to_state": to_state,
                                                     "reason": f"{user.username} decided",
                                                     "version": version},
                                   headers={"HX-Request": "true"})
            results[user.username] = response.content.decode()
        finally:
            connections.close_all()

    threads = [threading.Thread(target=reviewer_decides, args=(users[0], State.SUCCEEDED)),
               threading.Thread(target=reviewer_decides, args=(users[1], State.ABANDONED))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    events = human_events(op)
    assert len(events) == 1
    winner = events[0].actor_id
    loser = "bob" if winner == "alice" else "alice"
    assert "Recorded:" in results[winner]
    assert f"Nothing recorded: {winner} (human) already moved this operation" in results[loser]
    assert Operation.objects.get(pk=op.pk).state == events[0].to_state
