"""The desk's unknown-outcome policies page: admins see and set policies (with a reason,
shown in the change log); reviewers and viewers are refused; a policy set here changes the
reconciler's next verdict."""

from __future__ import annotations

import pytest
from django.urls import reverse

from ledger import reconcile
from ledger.models import UnknownOutcomePolicy, UnknownOutcomePolicyChange
from ledger.states import State
from tests.ledger.test_outcome_policies import charge, reason_of, settle

FORM = {"pattern": "payments.*", "tenant": "default", "attempts": "2", "window_minutes": "30",
        "reason": "a charge is never repeated without a person"}


@pytest.mark.django_db
@pytest.mark.parametrize("role", ["reviewer", "viewer"])
def test_reviewers_and_viewers_are_refused(client, request, role):
    client.force_login(request.getfixturevalue(role))
    assert client.get(reverse("review:outcome_policies")).status_code == 403
    assert client.post(reverse("review:outcome_policy_set"), FORM).status_code == 403
    assert "Unknown outcomes" not in client.get(reverse("review:queue")).content.decode()
    assert not UnknownOutcomePolicy.objects.exists()
    assert not UnknownOutcomePolicyChange.objects.exists()


@pytest.mark.django_db
def test_an_admin_sets_a_policy_with_a_reason_and_the_reconciler_follows_it(
        client, admin_user, settings):
    settings.LEDGER_UNKNOWN_OUTCOME_POLICIES = {"mail.*": {"attempts": 5}}
    client.force_login(admin_user)
    page = client.get(reverse("review:outcome_policies")).content.decode()
    assert "No policy set on the desk" in page and "mail.*" in page  # the setting's default
    # automatic_retry unchecked: a proven absence goes to a person
    response = client.post(reverse("review:outcome_policy_set"), FORM)
    assert response.status_code == 302
    policy = UnknownOutcomePolicy.objects.get()
    assert (policy.automatic_retry, policy.attempts, policy.not_yet_window.total_seconds()) == (
        False, 2, 1800)
    change = UnknownOutcomePolicyChange.objects.get()
    assert (change.reason, change.changed_by_name) == (FORM["reason"], "admin")
    page = client.get(reverse("review:outcome_policies")).content.decode()
    assert "payments.*" in page and FORM["reason"] in page and "never: a person decides" in page
    op = settle(charge("absent"))
    assert op.state == State.MANUAL_REVIEW and "(set on the desk)" in reason_of(op)
    # changed again on the desk: automatic retry allowed, the next verdict follows
    response = client.post(reverse("review:outcome_policy_set"),
                           {**FORM, "automatic_retry": "on", "reason": "provider fixed"},
                           headers={"HX-Request": "true"})
    assert response.status_code == 200 and "provider fixed" in response.content.decode()
    assert UnknownOutcomePolicyChange.objects.count() == 2
    assert reconcile.effective_unknown_outcome_policy("payments.charge",
                                                      "default").automatic_retry
    assert settle(charge("absent")).state == State.SAFE_TO_RETRY


@pytest.mark.django_db
def test_a_change_without_a_reason_or_with_a_bad_pattern_writes_nothing(client, admin_user):
    client.force_login(admin_user)
    response = client.post(reverse("review:outcome_policy_set"), {**FORM, "reason": ""})
    assert response.status_code == 422 and "Nothing written" in response.content.decode()
    response = client.post(reverse("review:outcome_policy_set"),
                           {**FORM, "pattern": "bad pattern"})
    assert response.status_code == 422 and "Nothing written" in response.content.decode()
    assert not UnknownOutcomePolicy.objects.exists()
    assert not UnknownOutcomePolicyChange.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("page, setter, form, heading, reason_column", [
    ("approval_policies", "approval_policy_set",
     {"pattern": "payments.*", "tenant": "default", "approvals_needed": 1, "ttl_hours": 4,
      "requires_approval": "on"}, "append-only", False),
    ("outcome_policies", "outcome_policy_set", FORM, "append-only, under the records chain",
     True),
])
def test_both_policy_pages_write_their_change_log_with_the_one_partial(
        client, admin_user, page, setter, form, heading, reason_column):
    client.force_login(admin_user)
    assert client.post(reverse(f"review:{setter}"), form).status_code == 302
    for headers in ({}, {"HX-Request": "true"}):
        response = client.get(reverse(f"review:{page}"), headers=headers)
        assert "review/_policy_changes.html" in [t.name for t in response.templates]
        body = response.content.decode()
        assert f'<h2>Changes <span class="muted">{heading}</span></h2>' in body
        assert ('<th scope="col">Reason</th>' in body) is reason_column
        assert ('<td data-label="Reason" class="wrap">' in body) is reason_column
        assert '<span class="muted">created:</span>' in body
