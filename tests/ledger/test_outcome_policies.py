"""Unknown-outcome policies per kind of operation, set by admins (ledger.outcome_policies):
a desk row changes the reconciler's verdict in a real pass and wins over the setting, every
change is audited with its reason, and a row rewritten behind the desk's back is reported by
verify_audit (the records chain)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.db import connection
from django.db.utils import DatabaseError

from ledger import chain, outcome_policies, reconcile
from ledger.errors import InvalidInput, PermissionDenied
from ledger.models import (
    Evidence,
    OperationEvent,
    RecordLink,
    UnknownOutcomePolicy,
    UnknownOutcomePolicyChange,
)
from ledger.states import State
from tests.factories import OperationFactory
from tests.ledger.test_verify_audit_tamper import tamper, verify_audit


@reconcile.register("payments.charge")
class Charges(reconcile.Reconciler):
    """A payments service as the intent scripts it: absent, or down."""

    backoff_initial = timedelta(0)
    grace_period = timedelta(days=1)
    trusted_absence = "a test double: the intent says what the service shows"

    def lookup(self, op):
        if op.intent["answer"] == "raise":
            raise ConnectionError("payments service down")
        return reconcile.ProvenAbsent({"matches": []})


def charge(answer, *, tenant="default"):
    return OperationFactory(state=State.OUTCOME_UNKNOWN, operation="payments.charge",
                            tenant=tenant,
                            intent={"n": time.monotonic_ns(), "answer": answer})


def reason_of(op):
    return OperationEvent.objects.filter(operation=op).order_by("-version").first().reason


def settle(op):
    reconcile.run_once(worker="w1")
    op.refresh_from_db()
    return op


@pytest.mark.django_db
def test_without_a_policy_a_proven_absence_is_safe_to_retry():
    assert settle(charge("absent")).state == State.SAFE_TO_RETRY


@pytest.mark.django_db
def test_a_desk_policy_sends_a_proven_payment_absence_to_a_person_over_the_setting(
        settings, admin_user):
    settings.LEDGER_UNKNOWN_OUTCOME_POLICIES = {"payments.*": {"automatic_retry": True}}
    outcome_policies.set_policy("payments.*", user=admin_user, automatic_retry=False,
                                reason="a charge is never repeated without a person")
    op = settle(charge("absent"))
    [ev] = Evidence.objects.filter(operation=op)
    assert (op.state, ev.verdict) == (State.MANUAL_REVIEW, "proven_absent")
    assert ("unknown-outcome policy for 'payments.*' sends no retry without a person "
            "(set on the desk)") in reason_of(op)
    # the policy is the tenant's: another tenant's payments follow the setting
    assert settle(charge("absent", tenant="acme")).state == State.SAFE_TO_RETRY
    assert reconcile.effective_unknown_outcome_policy("payments.charge", "acme") == \
        reconcile.UnknownOutcomePolicy(pattern="payments.*", source="setting")


@pytest.mark.django_db
def test_a_desk_policy_sets_the_readings_before_manual_review(admin_user):
    outcome_policies.set_policy("payments.*", user=admin_user, attempts=2,
                                reason="two readings are enough")
    op = settle(charge("raise"))
    assert op.state == State.OUTCOME_UNKNOWN and "(1 of 2)" in reason_of(op)
    op = settle(op)
    assert op.state == State.MANUAL_REVIEW
    assert "reconciler failed 2 times (limit 2)" in reason_of(op)


@pytest.mark.django_db
def test_the_exact_name_wins_over_a_pattern_and_the_window_bounds_not_yet(admin_user):
    outcome_policies.set_policy("payments.*", user=admin_user, attempts=7, reason="broad")
    outcome_policies.set_policy("payments.charge", user=admin_user, attempts=3,
                                window=timedelta(minutes=5), reason="exact")
    outcome_policies.set_policy("pay*", user=admin_user, attempts=9, reason="broader")
    policy = reconcile.effective_unknown_outcome_policy("payments.charge", "default")
    assert (policy.pattern, policy.attempts, policy.window, policy.source) == (
        "payments.charge", 3, timedelta(minutes=5), "desk")
    assert reconcile.effective_unknown_outcome_policy("payments.refund", "default").attempts == 7
    assert reconcile.effective_unknown_outcome_policy("mail.send", "default") == \
        reconcile.UnknownOutcomePolicy()


@pytest.mark.django_db
def test_each_change_is_audited_with_its_reason_and_nothing_when_nothing_changes(admin_user):
    outcome_policies.set_policy("payments.*", user=admin_user, automatic_retry=False,
                                reason="chargebacks last quarter")
    outcome_policies.set_policy("payments.*", user=admin_user, automatic_retry=False,
                                reason="same again")
    outcome_policies.set_policy("payments.*", user=admin_user, automatic_retry=False,
                                attempts=4, reason="the provider is slow to list")
    first, second = UnknownOutcomePolicyChange.objects.order_by("id")
    assert (first.before, first.after["automatic_retry"], first.reason,
            first.changed_by_id, first.changed_by_name) == (
        None, False, "chargebacks last quarter", admin_user.pk, "admin")
    assert (second.before["attempts"], second.after["attempts"], second.reason) == (
        None, 4, "the provider is slow to list")
    policy = UnknownOutcomePolicy.objects.get()
    assert (policy.attempts, policy.updated_by_id) == (4, admin_user.pk)
    # the change log is append-only, in PostgreSQL
    with pytest.raises(DatabaseError, match="append-only"):
        UnknownOutcomePolicyChange.objects.filter(pk=first.pk).update(reason="nothing")


@pytest.mark.django_db
def test_only_admins_set_policies_and_every_input_is_checked(admin_user, reviewer, viewer):
    for person in (reviewer, viewer):
        with pytest.raises(PermissionDenied, match="change_unknownoutcomepolicy"):
            outcome_policies.set_policy("payments.*", user=person, automatic_retry=False,
                                        reason="I would like to")
        with pytest.raises(PermissionDenied, match="view_unknownoutcomepolicy"):
            outcome_policies.policies_page(person)
    for bad, match in (({"reason": " "}, "non-empty reason"),
                       ({"reason": "r", "attempts": 0}, "attempts from 1"),
                       ({"reason": "r", "window": timedelta(0)}, "window"),
                       ({"reason": "r", "automatic_retry": "no"}, "boolean")):
        with pytest.raises(InvalidInput, match=match):
            outcome_policies.set_policy("payments.*", user=admin_user, **bad)
    with pytest.raises(InvalidInput, match="pattern"):
        outcome_policies.set_policy("pay ments", user=admin_user, reason="r")
    assert not UnknownOutcomePolicy.objects.exists()
    assert not UnknownOutcomePolicyChange.objects.exists()


@pytest.mark.django_db
def test_a_verdict_still_takes_four_statements_with_the_desk_policy(admin_user):
    from django.test.utils import CaptureQueriesContext

    outcome_policies.set_policy("payments.*", user=admin_user, automatic_retry=False,
                                reason="never without a person")
    op = charge("absent")
    claim = reconcile.claim_next(worker="w1")
    outcome = reconcile.consult(claim.operation)
    with CaptureQueriesContext(connection) as settling:
        reconcile.settle(claim, outcome)
    sent = [q["sql"] for q in settling if "SAVEPOINT" not in q["sql"]]
    assert len(sent) == 4, sent
    op.refresh_from_db()
    assert op.state == State.MANUAL_REVIEW


@pytest.mark.django_db(transaction=True)
def test_a_policy_row_or_its_change_rewritten_out_of_band_is_reported(admin_user):
    policy = outcome_policies.set_policy("payments.*", user=admin_user, automatic_retry=False,
                                         reason="never without a person")
    change = UnknownOutcomePolicyChange.objects.get()
    assert set(RecordLink.objects.values_list("source", flat=True)) >= {
        "unknown_outcome_policy", "unknown_outcome_policy_change"}
    chain.seal()
    assert chain.verify(actor="before").is_intact
    tamper(("UPDATE ledger_unknownoutcomepolicy SET automatic_retry = true WHERE id = %s",
            [policy.pk]),
           ("UPDATE ledger_unknownoutcomepolicychange SET reason = 'approved by the CFO' "
            "WHERE id = %s", [change.pk]))
    status, out, err = verify_audit()
    assert status == 1 and "Traceback" not in err, (out, err)
    lines = err.splitlines()
    assert any(line.startswith(f"record unknown_outcome_policy {policy.pk} (default")
               and "differs from its last record link in automatic_retry" in line
               for line in lines), err
    assert any(line.startswith(f"record unknown_outcome_policy_change {change.pk} (default")
               and "differs from its last record link in reason" in line
               for line in lines), err
