"""Operation detail: receipt, escaped intent, timeline, evidence, duplicates, actions."""

import pytest
from django.urls import reverse

from ledger.states import State
from tests.factories import OperationFactory, UserFactory, add_evidence

HOSTILE = {
    "title": "<img src=x onerror=alert(1)>",
    "body": "</script><script>alert(1)</script>",
    "headers": {"Authorization": "Bearer sk-live-123"},
}


def url(op):
    return reverse("review:operation", args=[op.operation_id])


@pytest.mark.django_db
def test_detail_shows_receipt_fingerprint_timeline_and_every_evidence(client, reviewer):
    op = OperationFactory(state=State.RECONCILING, idempotency_key="key-detail")
    add_evidence(op, verdict="not_yet", observed={"status": "pending"})
    add_evidence(op, verdict="ambiguous", to_state=State.MANUAL_REVIEW,
                 observed={"matches": [{"id": "article-31"}, {"id": "article-32"}]},
                 detail="two articles with this title")
    client.force_login(reviewer)
    body = client.get(url(op)).content.decode()
    for text in (op.operation_id, op.intent_fingerprint, "key-detail", "article-31",
                 "article-32", "not_yet", "two articles with this title",
                 "test setup: to submitted", "verdict ambiguous", "reconciler-test"):
        assert text in body, text
    assert body.count('class="evidence"') == 2
    assert body.count("<tr class=\"actor-") == 5  # planned, submitted, unknown, reconciling, manual


@pytest.mark.django_db
def test_agent_written_intent_renders_escaped_and_redacted(client, reviewer):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN, intent=HOSTILE)
    client.force_login(reviewer)
    body = client.get(url(op)).content.decode()
    assert "<img src=x" not in body and "</script><script>alert" not in body
    assert "&lt;img src=x onerror=alert(1)&gt;" in body
    assert "&lt;/script&gt;&lt;script&gt;alert(1)&lt;/script&gt;" in body
    assert "sk-live-123" not in body and "[redacted]" in body


@pytest.mark.django_db
def test_operations_with_the_same_fingerprint_are_listed_and_linked(client, reviewer):
    intent = {"title": "Twice", "body": "same"}
    first = OperationFactory(state=State.SUCCEEDED, intent=intent, idempotency_key="a")
    second = OperationFactory(state=State.OUTCOME_UNKNOWN, intent=intent, idempotency_key="b")
    unrelated = OperationFactory(state=State.SUCCEEDED, intent={"title": "Other"})
    client.force_login(reviewer)
    body = client.get(url(second)).content.decode()
    assert f'href="{url(first)}"' in body
    assert unrelated.operation_id not in body


@pytest.mark.django_db
def test_reviewer_is_offered_the_three_decisions_on_an_unknown_outcome(client, reviewer):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    client.force_login(reviewer)
    body = client.get(url(op)).content.decode()
    for label in ("Mark succeeded", "Safe to retry", "Abandon"):
        assert f">{label}</button>" in body
    assert f'name="version" value="{op.version}"' in body


@pytest.mark.django_db
def test_never_retry_operation_offers_safe_to_retry_only_to_admins(client, reviewer, admin_user):
    op = OperationFactory(state=State.MANUAL_REVIEW, retry_policy="never")
    client.force_login(reviewer)
    body = client.get(url(op)).content.decode()
    assert ">Safe to retry</button>" not in body and ">Abandon</button>" in body
    client.force_login(admin_user)
    assert ">Safe to retry</button>" in client.get(url(op)).content.decode()


@pytest.mark.django_db
@pytest.mark.parametrize("state", [State.SUCCEEDED, State.SAFE_TO_RETRY, State.SUBMITTED])
def test_no_decision_is_offered_outside_review_states(client, reviewer, state):
    op = OperationFactory(state=state)
    client.force_login(reviewer)
    body = client.get(url(op)).content.decode()
    assert "<button type=\"submit\" name=\"to_state\"" not in body


@pytest.mark.django_db
def test_viewer_sees_the_operation_but_no_action_buttons(client, viewer):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    client.force_login(viewer)
    body = client.get(url(op)).content.decode()
    assert op.operation_id in body
    assert 'name="to_state"' not in body and "cannot resolve" in body


@pytest.mark.django_db
def test_another_tenants_operation_is_not_found(client):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN, tenant="acme")
    client.force_login(UserFactory(username="r2", role="reviewer", tenants=["default"]))
    assert client.get(url(op)).status_code == 404


@pytest.mark.django_db
def test_detail_runs_a_fixed_number_of_queries(client, reviewer, django_assert_num_queries):
    op = OperationFactory(state=State.RECONCILING)
    for n in range(4):
        add_evidence(op, verdict="not_yet", observed={"try": n})
    add_evidence(op, verdict="ambiguous", to_state=State.MANUAL_REVIEW)
    client.force_login(reviewer)
    # session, user, user perms, group perms, tenant grants, operation, events, evidence,
    # same fingerprint, approvals, live claim, notes, proposals (the two-person rule)
    with django_assert_num_queries(13):
        assert client.get(url(op)).status_code == 200


@pytest.mark.django_db
def test_htmx_request_gets_only_the_decision_fragment(client, reviewer):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    client.force_login(reviewer)
    body = client.get(url(op), headers={"HX-Request": "true"}).content.decode()
    assert body.lstrip().startswith('<section id="decision"') and "<html" not in body


@pytest.mark.django_db
def test_a_settled_operation_shows_its_result_redacted_and_says_how_it_was_settled(
        client, reviewer, django_assert_num_queries):
    from ledger import receipts

    op = OperationFactory(state=State.SUBMITTED)
    receipts.mark_succeeded(op, external_id="article-77",
                            result={"id": "article-77", "api_key": "sk-live-secret-123"})
    client.force_login(reviewer)
    with django_assert_num_queries(12):  # as any settled one: no claim to read
        page = client.get(url(op)).content.decode()
    result = page[page.index('id="result"'):]
    assert "article-77" in result and "sk-live-secret-123" not in page
    assert "[redacted]" in result
    assert 'id="external-id">article-77<' in page
    settled = page[page.index('id="settled"'):][:400]
    assert "Succeeded by its agent" in settled and "the external system confirmed it" in settled
    assert "No reconciler has looked at this operation yet." not in page
    assert "No evidence from a reconciler: succeeded by its agent" in page
