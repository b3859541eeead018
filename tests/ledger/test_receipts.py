"""Action receipts: recording intents, their outcomes, idempotency and bad input."""

import json
import math
import signal

import pytest
from django.db import connection

from ledger import receipts, transitions
from ledger.canonical import REDACTED
from ledger.errors import (
    IdempotencyKeyReused,
    IllegalTransition,
    InvalidInput,
    LedgerError,
    PermissionDenied,
    StaleVersion,
)
from ledger.models import Operation, OperationEvent
from ledger.states import State
from tests.factories import OperationFactory, UserFactory
from tests.support.concurrency import join, run_threads
from tests.support.processes import spawn, wait_for_line


class ClientError(Exception):
    """What an HTTP client raises for a 4xx: the service refused the request."""


def record(**kwargs):
    args = {"operation": "articles.create", "target": "https://articles.example/api",
            "intent": {"title": "Hello", "body": "World"}}
    args.update(kwargs)
    return receipts.record_intent(args.pop("operation"), args.pop("target"), args.pop("intent"),
                                  **args)


# --- submit() ---------------------------------------------------------------------------


@pytest.mark.django_db
def test_submit_success_marks_succeeded_with_the_external_id():
    op = record()
    calls = []
    with receipts.submit(op, rejections=(ClientError,)) as attempt:
        calls.append(1)
        attempt.succeeded(external_id="article-17")
    op.refresh_from_db()
    assert (op.state, op.external_id, op.attempt) == (State.SUCCEEDED, "article-17", 1)
    assert op.completed_at is not None
    assert calls == [1]


@pytest.mark.django_db
def test_submit_normal_exit_without_an_explicit_success_is_succeeded():
    op = record()
    with receipts.submit(op):
        pass
    op.refresh_from_db()
    assert op.state == State.SUCCEEDED


@pytest.mark.django_db
def test_submit_explicit_rejection_marks_rejected_and_reraises():
    op = record()
    calls = []
    with pytest.raises(ClientError), receipts.submit(op, rejections=(ClientError,)):
        calls.append(1)
        raise ClientError("422 title already taken")
    op.refresh_from_db()
    assert (op.state, op.error_code) == (State.REJECTED, "ClientError")
    assert "422 title already taken" in op.error_detail
    assert calls == [1]


@pytest.mark.django_db
def test_submit_transport_failure_is_outcome_unknown_never_failed_and_not_retried():
    op = record()
    calls = []
    with pytest.raises(TimeoutError), receipts.submit(op, rejections=(ClientError,)):
        calls.append(1)
        raise TimeoutError("read timed out")
    op.refresh_from_db()
    assert (op.state, op.error_code, op.attempt) == (State.OUTCOME_UNKNOWN, "TimeoutError", 1)
    assert op.unknown_since is not None
    assert calls == [1]
    transitions = list(op.events.order_by("version").values_list("to_state", flat=True))
    assert transitions == ["planned", "submitted", "outcome_unknown"]


@pytest.mark.django_db
def test_the_three_endings_of_submit_are_three_different_states():
    endings = {}
    for name, exc in (("ok", None), ("rejected", ClientError), ("lost", ConnectionError)):
        op = record(idempotency_key=f"endings-{name}")
        try:
            with receipts.submit(op, rejections=(ClientError,)):
                if exc:
                    raise exc(name)
        except (ClientError, ConnectionError):
            pass
        op.refresh_from_db()
        endings[name] = op.state
    assert endings == {"ok": "succeeded", "rejected": "rejected", "lost": "outcome_unknown"}


@pytest.mark.django_db
def test_an_exception_after_success_does_not_change_the_recorded_success():
    op = record()
    with pytest.raises(KeyError), receipts.submit(op) as attempt:
        attempt.succeeded(external_id="a-1")
        raise KeyError("bug after the call")
    op.refresh_from_db()
    assert op.state == State.SUCCEEDED


@pytest.mark.django_db
def test_safe_to_retry_resubmits_as_the_next_attempt_with_the_same_key():
    op = OperationFactory(state=State.SAFE_TO_RETRY, idempotency_key="retry-me")
    receipts.mark_submitted(op)
    op.refresh_from_db()
    assert (op.state, op.attempt, op.idempotency_key) == (State.SUBMITTED, 2, "retry-me")


@pytest.mark.django_db
def test_an_agent_cannot_take_a_human_decision():
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    with pytest.raises(IllegalTransition, match="expected a person"):
        receipts.mark_succeeded(op)
    op.refresh_from_db()
    assert op.state == State.OUTCOME_UNKNOWN


@pytest.mark.django_db
def test_finishing_twice_is_refused():
    op = record()
    receipts.mark_submitted(op)
    receipts.mark_succeeded(op, external_id="e-1")
    with pytest.raises(IllegalTransition, match="succeeded -> one of none \\(terminal\\)"):
        receipts.mark_outcome_unknown(op, error_code="timeout")


# --- idempotency ------------------------------------------------------------------------


@pytest.mark.django_db
def test_same_key_and_intent_returns_existing_operation():
    first = record(idempotency_key="k-1")
    receipts.mark_submitted(first)
    again = record(idempotency_key="k-1")
    assert again.pk == first.pk
    assert again.state == State.SUBMITTED
    assert Operation.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_replay_returns_the_operation_as_the_orm_reads_it():
    # Outside a test transaction: the agent's autocommit path, prepared look-up included.
    intent = {"title": "Hello", "body": {"text": "World", "tags": ["a"]}, "n": 1.5}
    first = record(idempotency_key="k-1", intent=intent)
    receipts.mark_submitted(first)
    again = record(idempotency_key="k-1", intent=intent)
    fresh = Operation.objects.get(pk=first.pk)
    for field in Operation._meta.concrete_fields:
        assert getattr(again, field.attname) == getattr(fresh, field.attname), field.name
    assert again.intent == intent
    assert again.state == State.SUBMITTED and not again._state.adding


@pytest.mark.django_db(transaction=True)
def test_the_hot_statements_are_prepared_on_the_server():
    # settings give the connection a prepare_threshold; without it they would be planned
    # at every call (bench/ P1 measures the difference).
    op = record(idempotency_key="k-prepared")
    receipts.mark_submitted(op)
    assert record(idempotency_key="k-prepared").pk == op.pk  # a replay: the look-up
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        prepared = [row[0] for row in cursor.fetchall()]
    assert any(s.startswith("WITH changed AS (INSERT INTO ledger_operation") for s in prepared)
    assert any(s.startswith("WITH changed AS (UPDATE ledger_operation") for s in prepared)
    assert any("WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3" in s
               for s in prepared)


@pytest.mark.django_db
def test_different_keys_make_two_operations():
    a = record(idempotency_key="k-a")
    b = record(idempotency_key="k-b")
    assert a.pk != b.pk
    assert Operation.objects.count() == 2


@pytest.mark.django_db
def test_no_key_generates_one_so_two_calls_are_two_operations():
    a, b = record(), record()
    assert a.idempotency_key and b.idempotency_key and a.idempotency_key != b.idempotency_key
    assert Operation.objects.count() == 2


@pytest.mark.django_db
def test_same_key_with_a_different_intent_raises_idempotency_key_reused():
    first = record(idempotency_key="k-1")
    with pytest.raises(IdempotencyKeyReused, match=first.operation_id) as info:
        record(idempotency_key="k-1", intent={"title": "Another"})
    assert info.value.existing.pk == first.pk
    assert Operation.objects.count() == 1


@pytest.mark.django_db
def test_the_same_key_in_another_tenant_is_another_operation():
    a = record(idempotency_key="k-1")
    b = record(idempotency_key="k-1", tenant="acme")
    assert a.pk != b.pk


def test_derived_idempotency_keys_are_stable():
    assert receipts.idempotency_key("run-1", "step-a") == receipts.idempotency_key("run-1",
                                                                                   "step-a")
    assert receipts.idempotency_key("run-1", "step-a") != receipts.idempotency_key("run-1",
                                                                                   "step-b")
    assert receipts.idempotency_key("run-1", "step-a") != receipts.idempotency_key("run-1s",
                                                                                   "tep-a")


@pytest.mark.django_db(transaction=True)
def test_eight_threads_racing_the_same_key_make_one_operation():
    threads, results, errors = run_threads(8, lambda i: record(idempotency_key="race-key").pk)
    join(threads)
    assert errors == []
    assert len(set(results)) == 1
    assert Operation.objects.filter(idempotency_key="race-key").count() == 1
    assert OperationEvent.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_eight_threads_racing_to_finish_one_operation_have_exactly_one_winner():
    op = record(idempotency_key="finish-race")
    receipts.mark_submitted(op)

    def finish(i):
        mine = Operation.objects.get(pk=op.pk)
        if i % 2:
            return receipts.mark_succeeded(mine, external_id=f"e-{i}").state
        return receipts.mark_outcome_unknown(mine, error_code="timeout").state

    threads, results, errors = run_threads(8, finish)
    join(threads)
    assert len(results) == 1
    assert len(errors) == 7
    assert all(isinstance(e, (StaleVersion, IllegalTransition)) for e in errors), errors
    op.refresh_from_db()
    assert op.version == 3
    assert OperationEvent.objects.filter(operation=op, version=3).count() == 1
    assert OperationEvent.objects.filter(operation=op).count() == 3


# --- secrets and fingerprints ------------------------------------------------------------

SECRET = "sk-live-very-secret-value"


@pytest.mark.django_db
def test_a_secret_in_headers_or_nested_fields_never_reaches_the_database():
    intent = {
        "title": "Hello",
        "headers": {"Authorization": f"Bearer {SECRET}", "X-Api-Key": SECRET,
                    "Cookie": f"session={SECRET}"},
        "auth": {"client": {"password": SECRET, "refresh_token": SECRET}},
        "items": [{"apiKey": SECRET, "name": "ok"}],
        "card": {"number": "4242424242424242"},
    }
    op = record(intent=intent, redact=["card.number"])
    with pytest.raises(TimeoutError), receipts.submit(op):
        raise TimeoutError(f"gateway said: Authorization: Bearer {SECRET}")
    with connection.cursor() as cursor:
        cursor.execute("SELECT row_to_json(o)::text FROM ledger_operation o")
        stored = " ".join(r[0] for r in cursor.fetchall())
        cursor.execute("SELECT row_to_json(e)::text FROM ledger_operationevent e")
        stored += " ".join(r[0] for r in cursor.fetchall())
    assert SECRET not in stored
    assert "4242424242424242" not in stored
    op.refresh_from_db()
    assert op.intent["headers"]["Authorization"] == REDACTED
    assert op.intent["items"][0] == {"apiKey": REDACTED, "name": "ok"}
    assert op.authentication_recorded is False


@pytest.mark.django_db
def test_the_fingerprint_does_not_depend_on_secret_values():
    a = record(intent={"title": "x", "headers": {"Authorization": "Bearer one"}})
    b = record(intent={"title": "x", "headers": {"Authorization": "Bearer two"}})
    assert a.intent_fingerprint == b.intent_fingerprint
    assert SECRET not in a.intent_fingerprint


@pytest.mark.django_db
def test_key_order_does_not_change_the_fingerprint():
    a = record(intent={"title": "x", "body": {"a": 1, "b": [1, 2]}})
    b = record(intent={"body": {"b": [1, 2], "a": 1}, "title": "x"})
    assert a.intent_fingerprint == b.intent_fingerprint
    assert a.intent_fingerprint.startswith("sha256:") and len(a.intent_fingerprint) == 71


@pytest.mark.django_db
def test_fingerprint_fields_limits_what_the_fingerprint_covers():
    a = record(intent={"title": "x", "request_id": "r-1"}, fingerprint_fields=["title"])
    b = record(intent={"title": "x", "request_id": "r-2"}, fingerprint_fields=["title"])
    c = record(intent={"title": "y", "request_id": "r-1"}, fingerprint_fields=["title"])
    assert a.intent_fingerprint == b.intent_fingerprint != c.intent_fingerprint
    # a replay with the same key and only an unlisted field changed is the same operation
    first = record(intent={"title": "x", "request_id": "1"}, fingerprint_fields=["title"],
                   idempotency_key="ff")
    again = record(intent={"title": "x", "request_id": "2"}, fingerprint_fields=["title"],
                   idempotency_key="ff")
    assert first.pk == again.pk


# --- crash ------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_process_killed_between_submitted_and_the_response_leaves_a_submitted_receipt():
    child = spawn(
        """
        import time
        from ledger import receipts
        op = receipts.record_intent("articles.create", "t", {"title": "crash"},
                                    idempotency_key="crash-1")
        with receipts.submit(op):
            print("SUBMITTED", op.operation_id, flush=True)
            time.sleep(60)   # waiting for a response that never comes
        """
    )
    line = wait_for_line(child, "SUBMITTED")
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    op = Operation.objects.get(operation_id=line.split()[1])
    assert (op.state, op.version) == (State.SUBMITTED, 2)
    assert list(op.events.values_list("to_state", flat=True)) == ["planned", "submitted"]


# --- bad input --------------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"intent": {"when": object()}}, "expected intent.when to hold only JSON values"),
        ({"intent": {1: "x"}}, "expected every key in intent to be a string"),
        ({"intent": ["not", "an", "object"]}, "expected intent to be a JSON object"),
        ({"intent": "text"}, "expected intent to be a JSON object"),
        ({"intent": {"score": math.nan}}, "NaN and Infinity are not JSON"),
        ({"intent": {"score": math.inf}}, "expected intent.score to be a finite JSON number"),
        ({"operation": ""}, "expected operation to be a non-empty string"),
        ({"operation": "   "}, "expected operation to be a non-empty string"),
        ({"operation": "has spaces"}, "expected operation to be a name like"),
        ({"tenant": ""}, "expected tenant to be a non-empty string"),
        ({"retry_policy": "always"}, "expected retry_policy one of"),
        ({"idempotency_key": ""}, "expected idempotency_key to be a non-empty string"),
        ({"redact": "card"}, "expected redact to be a list of dotted paths"),
        ({"run": "no-such-run"}, "expected run 'no-such-run' to exist"),
    ],
)
def test_bad_input_gets_a_clear_error_and_writes_nothing(kwargs, message):
    with pytest.raises(InvalidInput, match=message) as info:
        record(**kwargs)
    assert isinstance(info.value, ValueError) and isinstance(info.value, LedgerError)
    assert Operation.objects.count() == 0
    assert OperationEvent.objects.count() == 0


@pytest.mark.django_db
def test_a_ten_megabyte_intent_is_refused_with_its_size_limit():
    big = {"body": "x" * (10 * 1024 * 1024)}
    with pytest.raises(InvalidInput, match=r"at most 262,144 bytes .* found 10,485,7\d\d bytes"):
        record(intent=big)
    assert Operation.objects.count() == 0


@pytest.mark.django_db
def test_an_unknown_state_is_refused():
    op = record()
    with pytest.raises(InvalidInput, match="expected a state among"):
        transitions._apply(op, "exploded", actor_kind="system")
    reviewer = UserFactory(username="r", role="reviewer")
    with pytest.raises(InvalidInput, match="expected to_state one of"):
        receipts.resolve(op, "exploded", user=reviewer, reason="x")
    op.refresh_from_db()
    assert op.state == State.PLANNED


def test_canonical_json_is_compact_and_sorted():
    from ledger.canonical import canonical_json

    assert canonical_json({"b": 1, "a": [1, "é"]}) == json.dumps(
        {"a": [1, "é"], "b": 1}, separators=(",", ":"), ensure_ascii=False
    )


# --- resolve ----------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_reviewer_resolves_with_a_reason_and_the_decision_is_audited(reviewer):
    op = OperationFactory(state=State.MANUAL_REVIEW)
    receipts.resolve(op, State.SUCCEEDED, user=reviewer, reason="found it in the CMS",
                     external_id="art-9")
    op.refresh_from_db()
    assert (op.state, op.external_id) == (State.SUCCEEDED, "art-9")
    event = op.events.get(version=op.version)
    assert (event.actor_kind, event.actor_id, event.reason) == ("human", "reviewer",
                                                                "found it in the CMS")


@pytest.mark.django_db
def test_resolve_needs_a_reason(reviewer):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    with pytest.raises(InvalidInput, match="non-empty reason"):
        receipts.resolve(op, State.ABANDONED, user=reviewer, reason="  ")


@pytest.mark.django_db
def test_a_viewer_cannot_resolve(viewer):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    with pytest.raises(PermissionDenied, match="ledger.resolve_operation"):
        receipts.resolve(op, State.ABANDONED, user=viewer, reason="no")
    op.refresh_from_db()
    assert op.state == State.OUTCOME_UNKNOWN


@pytest.mark.django_db
def test_safe_to_retry_on_a_never_operation_needs_the_override(reviewer, admin_user):
    op = OperationFactory(state=State.MANUAL_REVIEW, retry_policy="never")
    with pytest.raises(PermissionDenied, match="override_retry_policy"):
        receipts.resolve(op, State.SAFE_TO_RETRY, user=reviewer, reason="checked")
    receipts.resolve(op, State.SAFE_TO_RETRY, user=admin_user, reason="checked by phone")
    assert op.state == State.MANUAL_REVIEW  # a proposal: it takes two people
    second = UserFactory(username="admin2", role="admin")
    receipts.resolve(op, State.SAFE_TO_RETRY, user=second, reason="checked again")
    assert op.state == State.SAFE_TO_RETRY


@pytest.mark.django_db
def test_resolve_refuses_another_tenants_operation():
    outsider = UserFactory(username="outsider", role="reviewer", tenants=["acme"])
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    with pytest.raises(PermissionDenied, match="tenant 'default'"):
        receipts.resolve(op, State.ABANDONED, user=outsider, reason="not mine")


@pytest.mark.django_db
def test_resolve_only_from_outcome_unknown_or_manual_review(reviewer):
    op = OperationFactory(state=State.SUBMITTED)
    with pytest.raises(IllegalTransition, match="found submitted"):
        receipts.resolve(op, State.SUCCEEDED, user=reviewer, reason="x")


@pytest.mark.django_db
def test_a_stale_decision_names_who_resolved_first(reviewer, admin_user):
    op = OperationFactory(state=State.MANUAL_REVIEW)
    seen_version = op.version
    receipts.resolve(Operation.objects.get(pk=op.pk), State.ABANDONED, user=admin_user,
                     reason="duplicate", expected_version=seen_version)
    with pytest.raises(StaleVersion, match="last changed by human admin") as info:
        receipts.resolve(op, State.SUCCEEDED, user=reviewer, reason="x",
                         expected_version=seen_version)
    assert info.value.last_event.actor_id == "admin"
    assert op.events.filter(actor_kind="human").count() == 1


@pytest.mark.django_db
def test_the_roles_come_from_a_migration():
    from django.contrib.auth.models import Group

    perms = {g.name: set(g.permissions.values_list("codename", flat=True))
             for g in Group.objects.filter(name__in=["viewer", "reviewer", "admin"])}
    assert "resolve_operation" not in perms["viewer"]
    assert "resolve_operation" in perms["reviewer"]
    assert "override_retry_policy" not in perms["reviewer"]
    assert {"resolve_operation", "override_retry_policy"} <= perms["admin"]


@pytest.mark.django_db
def test_the_migrated_roles_are_exactly_the_declared_ones():
    from django.contrib.auth.models import Group

    from ledger.roles import ROLE_PERMISSIONS

    for name, codenames in ROLE_PERMISSIONS.items():
        granted = set(Group.objects.get(name=name).permissions.values_list("codename", flat=True))
        assert granted == set(codenames), name


@pytest.mark.django_db(transaction=True)
def test_roles_and_the_default_policy_survive_the_flush_of_a_transactional_test():
    from django.contrib.auth.models import Group
    from django.core.management import call_command

    from ledger.models import RetentionPolicy, StateRetentionPolicy

    call_command("flush", interactive=False, verbosity=0)
    assert set(Group.objects.values_list("name", flat=True)) >= {"viewer", "reviewer", "admin"}
    assert Group.objects.get(name="reviewer").permissions.filter(
        codename="resolve_operation").exists()
    assert RetentionPolicy.objects.filter(pattern="*", tenant="").exists()
    # every kind's policy for every tenant, as the migrations made them (coverage: 0058)
    assert set(StateRetentionPolicy.objects.filter(tenant="").values_list("kind", flat=True)) \
        == {"facts", "episodes", "obligations", "coverage"}
