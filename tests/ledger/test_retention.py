"""Retention policies: which one governs, audited writes, preview, redaction, blockers."""

import re
from datetime import timedelta

import pytest
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from ledger import chain, retention
from ledger.canonical import REDACTED
from ledger.chain import verify
from ledger.errors import InvalidInput, PermissionDenied
from ledger.models import (
    Episode,
    Evidence,
    Operation,
    OperationEvent,
    PurgeRun,
    Redaction,
    RetentionChange,
    RetentionPolicy,
)
from ledger.selectors import retention as retention_reads
from ledger.states import State
from tests import factories
from tests.factories import OperationFactory
from tests.support.retention import complete_days_ago


def policy(pattern, tenant=""):
    # Unsaved rows are enough to rank and match.
    return RetentionPolicy(pattern=pattern, tenant=tenant, purge_after_days=30,
                           keep_events_days=30)


# --- which policy governs ---------------------------------------------------------------


def test_a_tenant_specific_policy_beats_any_tenant_policy_however_literal():
    policies = sorted([policy("articles.create"), policy("*", "acme")], key=retention.specificity)
    assert retention.resolve_policy("articles.create", "acme", policies).tenant == "acme"
    assert retention.resolve_policy("articles.create", "other", policies).pattern == (
        "articles.create")


def test_fewer_wildcards_win_then_the_longer_literal_prefix():
    ranked = sorted(
        [policy("*"), policy("*.create"), policy("articles.*"), policy("articles.c*"),
         policy("articles.create"), policy("articles.?reate")],
        key=retention.specificity,
    )
    assert [p.pattern for p in ranked] == [
        "articles.create", "articles.c*", "articles.?reate", "articles.*", "*.create", "*",
    ]
    assert retention.resolve_policy("articles.xreate", "t", ranked).pattern == (
        "articles.?reate")
    assert retention.resolve_policy("articles.create", "t", ranked).pattern == "articles.create"
    assert retention.resolve_policy("articles.crate", "t", ranked).pattern == "articles.c*"
    assert retention.resolve_policy("articles.delete", "t", ranked).pattern == "articles.*"
    assert retention.resolve_policy("mail.create", "t", ranked).pattern == "*.create"
    assert retention.resolve_policy("mail.send", "t", ranked).pattern == "*"


def test_no_matching_policy_resolves_to_none():
    assert retention.resolve_policy("mail.send", "t", [policy("articles.*")]) is None


@pytest.mark.django_db
def test_the_migration_creates_the_default_policy_and_records_it():
    default = RetentionPolicy.objects.get(pattern="*", tenant="")
    assert (default.purge_after_days, default.redact_after_days, default.keep_events_days) == (
        365, 90, 365)
    assert RetentionChange.objects.filter(policy_id=default.pk, action="created").exists()


# --- audited writes ---------------------------------------------------------------------


@pytest.mark.django_db
def test_set_policy_creates_then_updates_and_audits_who_before_and_after(admin_user):
    created = retention.set_policy("mail.*", purge_after_days=30, redact_after_days=7,
                                   user=admin_user)
    retention.set_policy("mail.*", purge_after_days=60, redact_after_days=7, user=admin_user)
    created.refresh_from_db()
    assert (created.purge_after_days, created.keep_events_days) == (60, 60)
    assert (created.created_by, created.updated_by) == (admin_user, admin_user)
    changes = list(RetentionChange.objects.filter(policy_id=created.pk).order_by("id"))
    assert [c.action for c in changes] == ["created", "updated"]
    assert changes[0].before is None and changes[0].after["purge_after_days"] == 30
    assert changes[1].before["purge_after_days"] == 30
    assert changes[1].after["purge_after_days"] == 60
    assert {c.changed_by_name for c in changes} == {"admin"}


@pytest.mark.django_db
def test_set_policy_that_changes_nothing_writes_nothing(admin_user):
    retention.set_policy("mail.*", purge_after_days=30, user=admin_user)
    before = RetentionChange.objects.count()
    retention.set_policy("mail.*", purge_after_days=30, user=admin_user)
    assert RetentionChange.objects.count() == before


@pytest.mark.django_db
def test_a_reviewer_cannot_change_retention(reviewer):
    with pytest.raises(PermissionDenied, match="change_retentionpolicy"):
        retention.set_policy("mail.*", purge_after_days=30, user=reviewer)
    assert not RetentionPolicy.objects.filter(pattern="mail.*").exists()


@pytest.mark.django_db
@pytest.mark.parametrize("kwargs, message", [
    ({"pattern": "mail.[ab]"}, "expected a pattern"),
    ({"pattern": ""}, "expected a pattern"),
    ({"purge_after_days": 0}, "purge_after_days to be a whole number"),
    ({"purge_after_days": "30"}, "purge_after_days to be a whole number"),
    ({"keep_events_days": -1}, "keep_events_days"),
    ({"redact_after_days": 31}, "redact_after_days at most purge_after_days"),
    ({"tenant": " acme"}, "expected tenant"),
])
def test_bad_policy_input_says_what_was_expected_and_writes_nothing(admin_user, kwargs,
                                                                   message):
    args = {"pattern": "mail.*", "purge_after_days": 30, **kwargs}
    changes = RetentionChange.objects.count()
    with pytest.raises(InvalidInput, match=message):
        retention.set_policy(args.pop("pattern"), user=admin_user, **args)
    assert RetentionChange.objects.count() == changes
    assert not RetentionPolicy.objects.exclude(pattern="*").exists()


@pytest.mark.django_db
def test_delete_policy_is_audited_and_the_default_cannot_be_deleted(admin_user):
    mail = retention.set_policy("mail.*", purge_after_days=30, user=admin_user)
    retention.delete_policy(mail, user=admin_user)
    assert not RetentionPolicy.objects.filter(pk=mail.pk).exists()
    deleted = RetentionChange.objects.get(policy_id=mail.pk, action="deleted")
    assert deleted.before["pattern"] == "mail.*" and deleted.after is None
    with pytest.raises(InvalidInput, match="default"):
        retention.delete_policy(RetentionPolicy.objects.get(pattern="*"), user=admin_user)
    assert RetentionPolicy.objects.filter(pattern="*").exists()


@pytest.mark.django_db
def test_saving_a_policy_in_django_admin_is_audited(client, admin_user):
    admin_user.is_staff = True
    admin_user.save(update_fields=["is_staff"])
    client.force_login(admin_user)
    response = client.post("/admin/ledger/retentionpolicy/add/", {
        "pattern": "mail.*", "tenant": "", "purge_after_days": "30",
        "redact_after_days": "10", "keep_events_days": "40",
    })
    assert response.status_code == 302, response.content.decode()[:2000]
    change = RetentionChange.objects.get(after__pattern="mail.*")
    assert (change.action, change.changed_by_name, change.after["keep_events_days"]) == (
        "created", "admin", 40)
    bad = client.post("/admin/ledger/retentionpolicy/add/", {
        "pattern": "mail.send", "tenant": "", "purge_after_days": "30",
        "redact_after_days": "31", "keep_events_days": "30",
    })
    assert bad.status_code == 200
    assert "redact_after_days at most purge_after_days" in bad.content.decode()
    assert not RetentionPolicy.objects.filter(pattern="mail.send").exists()


# --- preview ------------------------------------------------------------------------------


@pytest.mark.django_db
def test_preview_counts_per_policy_match_what_the_purge_then_does(admin_user):
    retention.set_policy("*", purge_after_days=30, redact_after_days=10, user=admin_user)
    retention.set_policy("mail.*", purge_after_days=5, user=admin_user)
    old_article = OperationFactory(state=State.SUCCEEDED)
    middling_article = OperationFactory(state=State.REJECTED)
    old_mail = OperationFactory(operation="mail.send", state=State.ABANDONED)
    young_mail = OperationFactory(operation="mail.send", state=State.SUCCEEDED)
    stuck = OperationFactory(state=State.OUTCOME_UNKNOWN)
    complete_days_ago(old_article, 40)
    complete_days_ago(middling_article, 20)
    complete_days_ago(old_mail, 6)
    complete_days_ago(young_mail, 4)
    complete_days_ago(stuck, 400)
    now = timezone.now()

    seen = {p.policy.pattern: p for p in retention_reads.preview(now=now)}
    assert (seen["*"].operations, seen["*"].events, seen["*"].redactions) == (1, 3, 1)
    assert seen["*"].first_operation_id == old_article.operation_id
    assert (seen["mail.*"].operations, seen["mail.*"].events) == (1, 2)

    result = retention.purge(actor="test", now=now)
    runs = {r.policy_snapshot["pattern"]: r for r in result.runs}
    for pattern, previewed in seen.items():
        run = runs[pattern]
        assert (run.operations_purged, run.events_purged, run.evidence_purged,
                run.operations_redacted) == (previewed.operations, previewed.events,
                                             previewed.evidence, previewed.redactions)
    assert set(result.purged_operation_ids) == {old_article.operation_id, old_mail.operation_id}
    assert result.redacted_operation_ids == [middling_article.operation_id]


# --- redaction --------------------------------------------------------------------------


def add_evidence(op, to_state=None, **observed):
    """The reconciler's evidence on `op`; with `to_state`, sealed by the verdict's event."""
    return factories.add_evidence(
        op, verdict="found", to_state=to_state, reconciler="articles",
        query={"q": "title:Secret plan"}, observed=observed or {"title": "Secret plan"},
        detail="matched title",
    )


@pytest.mark.django_db
def test_redaction_keeps_fingerprint_ids_and_states_removes_payloads_and_is_audited(admin_user):
    retention.set_policy("*", purge_after_days=30, redact_after_days=10, user=admin_user)
    op = OperationFactory(state=State.RECONCILING, intent={"title": "Secret plan", "body": "x"})
    add_evidence(op, to_state=State.SUCCEEDED)  # sealed by its event: verify_audit holds it
    complete_days_ago(op, 11)
    chain.seal()  # the purge would seal them first: compare the sealed events
    before = Operation.objects.get(pk=op.pk)
    events_before = list(OperationEvent.objects.filter(operation=op).values())

    result = retention.purge(actor="nightly cron")

    after = Operation.objects.get(pk=op.pk)
    assert after.intent == retention.REDACTED_PAYLOAD == {"retention": REDACTED}
    assert after.redacted_at is not None
    for name in ("operation_id", "intent_fingerprint", "idempotency_key", "state", "version",
                 "external_id", "completed_at", "tenant", "operation"):
        assert getattr(after, name) == getattr(before, name), name
    evidence = Evidence.objects.get(operation=op)
    assert (evidence.query, evidence.observed, evidence.detail) == (
        retention.REDACTED_PAYLOAD, retention.REDACTED_PAYLOAD, "")
    assert (evidence.verdict, evidence.redacted_at) == ("found", after.redacted_at)
    assert list(OperationEvent.objects.filter(operation=op).values()) == events_before
    record = Redaction.objects.get(operation_ref=op.operation_id)
    assert (record.intent_fingerprint, record.evidence_rows) == (op.intent_fingerprint, 1)
    assert record.purge_run.actor == "nightly cron"
    assert result.runs[0].operations_redacted == 1 and result.runs[0].evidence_redacted == 1
    # Redacted once: a second purge finds nothing more to do, and the chain still holds.
    assert retention.purge(actor="again").redacted_operation_ids == []
    assert verify(actor="test").is_intact


@pytest.mark.django_db
def test_redaction_never_touches_a_non_terminal_or_a_young_operation(admin_user):
    retention.set_policy("*", purge_after_days=30, redact_after_days=10, user=admin_user)
    stuck = OperationFactory(state=State.MANUAL_REVIEW, intent={"title": "keep"})
    young = OperationFactory(state=State.SUCCEEDED, intent={"title": "young"})
    complete_days_ago(stuck, 100)
    complete_days_ago(young, 9)
    retention.purge(actor="test")
    assert Operation.objects.get(pk=stuck.pk).intent == {"title": "keep"}
    assert Operation.objects.get(pk=young.pk).intent == {"title": "young"}
    assert not Redaction.objects.exists()


# --- the plug-in point for other modules' blockers -------------------------------------


@pytest.mark.django_db
def test_a_registered_blocker_keeps_an_operation_from_purge_and_redaction(admin_user,
                                                                         monkeypatch):
    retention.set_policy("*", purge_after_days=30, redact_after_days=10, user=admin_user)
    held, free, held_young, free_young = (OperationFactory(state=State.SUCCEEDED)
                                          for _ in range(4))
    for op in (held, held_young):
        add_evidence(op)
        Evidence.objects.create(operation=op, reconciler="articles", verdict="ambiguous",
                                created_at=timezone.now())
    complete_days_ago(held, 40)
    complete_days_ago(free, 40)
    complete_days_ago(held_young, 20)
    complete_days_ago(free_young, 20)
    monkeypatch.setattr(retention, "PURGE_BLOCKERS", [retention.Blocker(
        "ambiguous evidence",
        "EXISTS (SELECT 1 FROM ledger_evidence ev WHERE ev.operation_id = o.id "
        "AND ev.verdict = 'ambiguous')",
    )])
    previewed = retention_reads.preview()[0]
    assert (previewed.operations, previewed.redactions) == (1, 1)
    result = retention.purge(actor="test")
    assert result.purged_operation_ids == [free.operation_id]
    assert result.redacted_operation_ids == [free_young.operation_id]
    assert Operation.objects.filter(pk__in=[held.pk, held_young.pk], redacted_at=None).count() == 2


@pytest.mark.django_db
def test_purge_runs_are_recorded_even_when_nothing_is_eligible():
    result = retention.purge(actor="test", now=timezone.now() + timedelta(days=1))
    run = PurgeRun.objects.get(state_policy=None)
    assert result.runs == [run]
    assert (run.operations_purged, run.dry_run, run.policy.pattern) == (0, False, "*")
    assert run.finished_at is not None


# --- the sanctioned functions act only on what their run's policy governs (issue 41) ------

GOVERNED_TRIES = """
from django.db import connection, transaction

result = {}
for name, function, run, pk in tries:
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(f"SELECT {function}(%s, %s)", [run, [pk]])
            result[name] = ["accepted", [str(row[0]) for row in cursor.fetchall()]]
    except Exception as exc:
        result[name] = [getattr(exc.__cause__, "sqlstate", None), str(exc).splitlines()[0]]
"""


def _run_of(policy=None, state_policy=None) -> PurgeRun:
    return PurgeRun.objects.create(policy=policy, state_policy=state_policy, policy_snapshot={},
                                   actor="test", batch_size=10, started_at=timezone.now())


@pytest.mark.django_db(transaction=True)
def test_a_reconciler_redacts_and_purges_only_what_its_run_s_policy_governs():
    from ledger import episodes, retention_state, runs
    from tests.conftest import TEST_LOGINS
    from tests.support.processes import run_as
    from tests.support.retention import retention_admin

    admin = retention_admin()
    acme = retention.set_policy("acme.*", tenant="acme", purge_after_days=1,
                                redact_after_days=1, user=admin)
    every = retention.set_policy("*", purge_after_days=1, redact_after_days=1, user=admin)
    retention.set_policy("payments.*", purge_after_days=3650, redact_after_days=3650,
                         user=admin)
    ops = {"globex": OperationFactory(operation="acme.invoice", tenant="globex",
                                      state=State.SUCCEEDED),
           "other_name": OperationFactory(operation="billing.invoice", tenant="acme",
                                          state=State.SUCCEEDED),
           "stricter": OperationFactory(operation="payments.charge", tenant="acme",
                                        state=State.SUCCEEDED),
           "governed": OperationFactory(operation="acme.invoice", tenant="acme",
                                        state=State.SUCCEEDED)}
    for op in ops.values():
        complete_days_ago(op, 400)
    chain.seal()
    globex_run = runs.start("finished elsewhere", tenant="globex", run_id="globex-run")
    episode = episodes.record(globex_run, "user", content="globex's words")
    with connection.cursor() as cursor:
        cursor.execute("SET session_replication_role = replica")
        cursor.execute("UPDATE ledger_episode SET created_at = now() - interval '400 days' "
                       "WHERE id = %s", [episode.pk])
        cursor.execute("RESET session_replication_role")
    acme_episodes = retention_state.set_state_policy("episodes", tenant="acme",
                                                     purge_after_days=1, user=admin)
    acme_run, every_run, state_run = _run_of(acme), _run_of(every), _run_of(
        state_policy=acme_episodes)
    tries = []
    for function in ("ledger_retention_redact", "ledger_retention_purge"):
        tries += [(f"{function}:globex", function, acme_run.pk, ops["globex"].pk),
                  (f"{function}:other_name", function, acme_run.pk, ops["other_name"].pk),
                  (f"{function}:stricter", function, every_run.pk, ops["stricter"].pk),
                  (f"{function}:governed", function, acme_run.pk, ops["governed"].pk)]
    tries.append(("ledger_retention_purge_state:globex", "ledger_retention_purge_state",
                  state_run.pk, episode.pk))

    found = run_as(TEST_LOGINS["reconciler"], f"tries = {tries!r}\n" + GOVERNED_TRIES)

    governing = {"globex": "the policy \\* \\(every tenant\\)",
                 "other_name": "the policy \\* \\(every tenant\\)",
                 "stricter": "the policy payments.\\* \\(every tenant\\)"}
    for function in ("ledger_retention_redact", "ledger_retention_purge"):
        doing = "redaction" if function.endswith("redact") else "purge"
        for name, by in governing.items():
            outcome = found[f"{function}:{name}"]
            assert outcome[0] == "23514", f"expected {function} of {name} refused, found {outcome}"
            op = ops[name]
            assert re.search(f"operation {op.operation_id} \\({op.operation}, tenant {op.tenant}\\)"
                             f": expected an operation governed by run \\d+'s policy .* to "
                             f"{doing}, found it governed by {by}", outcome[1]), outcome[1]
        assert found[f"{function}:governed"] == ["accepted", [ops["governed"].operation_id]]
    state_outcome = found["ledger_retention_purge_state:globex"]
    assert state_outcome[0] == "23514", state_outcome
    assert "expected an episode of a finished run" in state_outcome[1], state_outcome

    kept = Operation.objects.filter(pk__in=[op.pk for op in ops.values()])
    assert {op.pk: op.redacted_at for op in kept} == {
        ops[name].pk: None for name in ("globex", "other_name", "stricter")}
    assert Episode.objects.filter(pk=episode.pk).exists()
    # The owner, who could call the functions directly, is held to the same rule.
    with pytest.raises(DatabaseError, match="expected an operation governed by"):
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SELECT ledger_retention_purge(%s, %s)",
                           [acme_run.pk, [ops["globex"].pk]])


@pytest.mark.django_db
def test_the_functions_pick_the_governing_policy_as_resolve_policy_does(admin_user):
    # The SQL's order of specificity against `retention.specificity`, as the owner: of these
    # policies, the purge of each operation is accepted under its governing policy's run
    # alone.
    from ledger.models import PurgeRun as Run

    for pattern, tenant in [("*", ""), ("*", "acme"), ("articles.*", ""), ("articles.c*", ""),
                            ("articles.?reate", ""), ("articles.create", ""),
                            ("art_cles.*", "")]:
        retention.set_policy(pattern, tenant=tenant, purge_after_days=1, user=admin_user)
    policies = retention.policies_by_specificity()
    names = [("articles.create", "acme"), ("articles.create", "globex"),
             ("articles.crop", "globex"), ("articles.zap", "globex"),
             ("artXcles.zap", "globex"), ("art_cles.zap", "globex")]
    ops = []
    for name, tenant in names:
        op = OperationFactory(operation=name, tenant=tenant, state=State.SUCCEEDED)
        complete_days_ago(op, 10)
        ops.append(op)
    chain.seal()
    for op in ops:
        expected = retention.resolve_policy(op.operation, op.tenant, policies)
        accepted = []
        for candidate in policies:
            run = Run.objects.create(policy=candidate, policy_snapshot={}, actor="t",
                                     batch_size=1, started_at=timezone.now())
            try:
                with transaction.atomic(), connection.cursor() as cursor:
                    cursor.execute("SELECT ledger_retention_purge(%s, %s)", [run.pk, [op.pk]])
                    raise _Undo
            except _Undo:
                accepted.append((candidate.pattern, candidate.tenant))
            except DatabaseError as exc:
                assert "expected an operation governed by" in str(exc), str(exc)
        assert accepted == [(expected.pattern, expected.tenant)], (
            f"{op.operation} in {op.tenant}: expected only {expected} to purge it, found "
            f"{accepted}")


class _Undo(Exception):
    pass
