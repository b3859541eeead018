"""Claims ("Ada is looking at this") and notes on an operation: ledger.claims and the desk."""

from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.db.utils import InternalError, ProgrammingError
from django.urls import reverse
from django.utils import timezone

from ledger import claims, errors
from ledger.models import Claim, OperationNote
from ledger.states import State
from tests.factories import OperationFactory, UserFactory

QUEUE = reverse("review:queue")


def page_of(op):
    return reverse("review:operation", args=[op.operation_id])


@pytest.fixture
def ada(db):
    return UserFactory(username="ada", role="reviewer")


@pytest.fixture
def bob(db):
    return UserFactory(username="bob", role="reviewer")


@pytest.fixture
def waiting(db):
    return OperationFactory(state=State.OUTCOME_UNKNOWN)


@pytest.mark.django_db
def test_a_claim_is_seen_by_another_reviewer_in_the_queue_and_on_the_page(client, ada, bob,
                                                                          waiting):
    client.force_login(ada)
    client.post(reverse("review:claim", args=[waiting.operation_id]))
    assert "you are looking at this" in client.get(QUEUE).content.decode()
    client.force_login(bob)
    queue = client.get(QUEUE).content.decode()
    assert "ada is looking at this" in queue
    detail = client.get(page_of(waiting)).content.decode()
    assert 'data-claimed-by="ada"' in detail and "is looking at this" in detail


@pytest.mark.django_db
def test_claiming_someone_elses_live_claim_is_refused_naming_the_holder(client, ada, bob,
                                                                        waiting):
    claims.claim(waiting, user=ada)
    with pytest.raises(errors.ClaimHeld) as refused:
        claims.claim(waiting, user=bob)
    assert refused.value.holder == "ada"
    assert "claimed by ada until" in str(refused.value)
    client.force_login(bob)
    body = client.post(reverse("review:claim", args=[waiting.operation_id]),
                       follow=True).content.decode()
    assert "Not claimed: ada is looking at this" in body
    assert Claim.objects.get(operation=waiting).claimed_by == ada


@pytest.mark.django_db
def test_a_claim_expires_after_fifteen_minutes_and_another_may_take_it(ada, bob, waiting):
    start = timezone.now()
    held = claims.claim(waiting, user=ada, now=start)
    assert held.expires_at == start + timedelta(minutes=15)
    assert claims.live_claim(waiting, now=start + timedelta(minutes=14)).claimed_by == ada
    assert claims.live_claim(waiting, now=start + timedelta(minutes=15)) is None
    with pytest.raises(errors.ClaimHeld):
        claims.claim(waiting, user=bob, now=start + timedelta(minutes=14, seconds=59))
    taken = claims.claim(waiting, user=bob, now=start + timedelta(minutes=15))
    assert taken.claimed_by == bob and Claim.objects.count() == 1


@pytest.mark.django_db
def test_reclaiming_renews_and_release_frees_the_operation(ada, bob, waiting):
    start = timezone.now()
    claims.claim(waiting, user=ada, now=start)
    renewed = claims.claim(waiting, user=ada, now=start + timedelta(minutes=10))
    assert renewed.expires_at == start + timedelta(minutes=25)
    with pytest.raises(errors.ClaimHeld):
        claims.release(waiting, user=bob, now=start + timedelta(minutes=11))
    assert claims.release(waiting, user=ada) is True
    assert claims.release(waiting, user=ada) is False
    assert claims.claim(waiting, user=bob).claimed_by == bob


@pytest.mark.django_db
def test_an_expired_claim_is_not_shown(client, ada, bob, waiting):
    claims.claim(waiting, user=ada, now=timezone.now() - timedelta(minutes=16))
    client.force_login(bob)
    assert "is looking at this" not in client.get(QUEUE).content.decode()
    assert 'data-claimed-by' not in client.get(page_of(waiting)).content.decode()


@pytest.mark.django_db
def test_a_note_is_escaped_in_the_timeline(client, ada, waiting):
    client.force_login(ada)
    response = client.post(reverse("review:add_note", args=[waiting.operation_id]),
                           {"text": "<script>alert(1)</script> checked the CMS"}, follow=True)
    body = response.content.decode()
    assert "&lt;script&gt;alert(1)&lt;/script&gt; checked the CMS" in body
    assert "<script>alert(1)" not in body
    assert 'class="note"' in body


@pytest.mark.django_db
def test_a_note_is_recorded_with_its_author_and_redacted(ada, waiting):
    note = claims.add_note(waiting, user=ada,
                           text="  tried with Authorization: Bearer abc.def.ghi  ")
    assert note.author == ada and note.author_name == "ada" and note.tenant == "default"
    assert "abc.def.ghi" not in note.text and note.text.startswith("tried with")
    with pytest.raises(errors.InvalidInput, match="expected a non-empty note"):
        claims.add_note(waiting, user=ada, text="   ")


@pytest.mark.django_db
def test_notes_are_append_only_in_postgresql(ada, waiting):
    claims.add_note(waiting, user=ada, text="first look")
    for statement in ("UPDATE ledger_operationnote SET text = 'rewritten'",
                      "DELETE FROM ledger_operationnote"):
        with pytest.raises((InternalError, ProgrammingError), match="append-only"), \
                transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(statement)
    assert OperationNote.objects.get().text == "first look"


@pytest.mark.django_db
def test_a_viewer_reads_notes_but_cannot_claim_or_write(client, viewer, ada, waiting):
    claims.add_note(waiting, user=ada, text="seen by the viewer")
    client.force_login(viewer)
    body = client.get(page_of(waiting)).content.decode()
    assert "seen by the viewer" in body and "Add a note" not in body
    assert client.post(reverse("review:claim", args=[waiting.operation_id])).status_code == 403
    assert client.post(reverse("review:add_note", args=[waiting.operation_id]),
                       {"text": "x"}).status_code == 403
    with pytest.raises(errors.PermissionDenied):
        claims.claim(waiting, user=viewer)
    with pytest.raises(errors.PermissionDenied):
        claims.add_note(waiting, user=viewer, text="x")
    assert not Claim.objects.exists() and OperationNote.objects.count() == 1


@pytest.mark.django_db
def test_a_reviewer_of_another_tenant_is_refused(client, other_tenant_reviewer, waiting):
    client.force_login(other_tenant_reviewer)
    for name in ("review:claim", "review:release", "review:add_note"):
        assert client.post(reverse(name, args=[waiting.operation_id]),
                           {"text": "x"}).status_code == 404
    with pytest.raises(errors.PermissionDenied, match="tenant 'default'"):
        claims.claim(waiting, user=other_tenant_reviewer)
    with pytest.raises(errors.PermissionDenied, match="tenant 'default'"):
        claims.add_note(waiting, user=other_tenant_reviewer, text="x")
    assert not Claim.objects.exists() and not OperationNote.objects.exists()


@pytest.mark.django_db
def test_claim_and_note_over_htmx_return_the_fresh_decision_fragment(client, ada, waiting):
    client.force_login(ada)
    response = client.post(reverse("review:claim", args=[waiting.operation_id]),
                           headers={"HX-Request": "true"})
    body = response.content.decode()
    assert response.status_code == 200 and body.lstrip().startswith('<section id="decision"')
    assert 'data-claimed-by="ada"' in body and "Release" in body
    body = client.post(reverse("review:add_note", args=[waiting.operation_id]),
                       {"text": "over htmx"}, headers={"HX-Request": "true"}).content.decode()
    assert "over htmx" in body


@pytest.mark.django_db(transaction=True)
def test_of_reviewers_claiming_at_once_exactly_one_wins_and_the_others_learn_who():
    from tests.factories import ensure_roles
    from tests.support.concurrency import join, run_threads

    ensure_roles()
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    people = [UserFactory(username=f"r{i}", role="reviewer") for i in range(6)]

    def take(i):
        return claims.claim(op, user=people[i]).claimed_by_name

    threads, results, refused = run_threads(len(people), take)
    join(threads)
    assert len(results) == 1 and len(refused) == len(people) - 1
    assert all(isinstance(e, errors.ClaimHeld) and e.holder == results[0] for e in refused)
    assert Claim.objects.get(operation=op).claimed_by_name == results[0]


@pytest.mark.django_db
@pytest.mark.parametrize("per_page", [1, 50])
def test_queue_with_claims_runs_a_fixed_number_of_queries(client, ada, bob, per_page,
                                                          django_assert_num_queries):
    ops = [OperationFactory(state=State.OUTCOME_UNKNOWN) for _ in range(55)]
    for op in ops[::2]:
        claims.claim(op, user=ada)
    client.force_login(bob)
    # session, user, user perms, group perms, tenant grants, page (claims in the same
    # query), grouped counts, conflicts, fact conflicts, overdue obligations
    with django_assert_num_queries(10):
        response = client.get(QUEUE, {"per_page": per_page})
    assert len(response.context["page"].items) == per_page


@pytest.mark.django_db
def test_operation_page_with_claim_and_notes_runs_a_fixed_number_of_queries(
        client, ada, bob, waiting, django_assert_num_queries):
    claims.claim(waiting, user=ada)
    for n in range(5):
        claims.add_note(waiting, user=ada, text=f"note {n}")
    client.force_login(bob)
    # session, user, user perms, group perms, tenant grants, operation, events, evidence,
    # same fingerprint, approvals, live claim, notes (one query for the five), proposals
    with django_assert_num_queries(13) as captured:
        client.get(page_of(waiting))
    notes = [q for q in captured.captured_queries if "ledger_operationnote" in q["sql"]]
    assert len(notes) == 1


@pytest.mark.django_db
def test_the_purge_removes_an_operations_claim_and_notes_with_it(ada):
    from ledger import retention
    from tests.support.retention import complete_days_ago, retention_admin

    retention.set_policy("*", purge_after_days=30, user=retention_admin())
    op = OperationFactory(state=State.SUCCEEDED)
    claims.claim(op, user=ada)
    claims.add_note(op, user=ada, text="checked, fine")
    complete_days_ago(op, 40)
    result = retention.purge(actor="test")
    assert op.operation_id in result.purged_operation_ids
    assert not Claim.objects.filter(operation_id=op.pk).exists()
    assert not OperationNote.objects.filter(operation_id=op.pk).exists()


@pytest.mark.django_db
def test_timeline_and_audit_times_are_relative_with_the_absolute_utc(client, ada, waiting):
    from datetime import UTC

    from review.templatetags.desk import ago

    note = claims.add_note(waiting, user=ada, text="looked",
                           now=timezone.now() - timedelta(minutes=3, seconds=5))
    stamp = note.created_at.astimezone(UTC)
    expected = (f'<time datetime="{stamp.isoformat()}" '
                f'title="{stamp:%Y-%m-%d %H:%M:%S} UTC">3 min ago</time>')
    assert ago(note.created_at) == expected
    assert "in 12 min" in ago(timezone.now() + timedelta(minutes=12, seconds=30))
    client.force_login(ada)
    assert expected in client.get(page_of(waiting)).content.decode()
    audit = client.get(reverse("review:audit")).content.decode()
    event = waiting.events.order_by("version").last().created_at.astimezone(UTC)
    assert f'<time datetime="{event.isoformat()}"' in audit


@pytest.mark.django_db(transaction=True)
def test_a_claim_pauses_the_reconciler_which_says_so_and_resumes_once_released():
    """The reconciler, logged in as its own role in a child process, leaves a claimed
    outcome_unknown operation alone, logs why, and takes it once the claim is released;
    the operation's page says the pause is on while the claim lasts."""
    from django.test import Client

    from tests.conftest import TEST_LOGINS
    from tests.support.processes import run_as

    ada = UserFactory(username="ada", role="reviewer")
    claimed = OperationFactory(state=State.OUTCOME_UNKNOWN, operation="nobody.reconciles")
    claims.claim(claimed, user=ada)
    client = Client()
    client.force_login(ada)
    page = client.get(page_of(claimed)).content.decode()
    assert "Automatic reconciliation is paused" in page and "until ada releases" in page

    pass_once = """
import io, logging
from ledger import reconcile
log = io.StringIO()
handler = logging.StreamHandler(log)
logging.getLogger("ledger.reconcile").addHandler(handler)
taken = reconcile.claim_next(worker="desk-test")
reconcile._log_paused("desk-test")
reconcile._log_paused("desk-test")  # said once per claim, not once per pass
result = {"taken": taken and taken.operation.operation_id, "log": log.getvalue()}
"""
    paused = run_as(TEST_LOGINS["reconciler"], pass_once)
    assert paused["taken"] is None, f"expected the claimed operation skipped, found {paused}"
    assert paused["log"].count(claimed.operation_id) == 1, paused["log"]
    assert "claimed by ada" in paused["log"] and "paused" in paused["log"]
    claimed.refresh_from_db()
    assert claimed.state == State.OUTCOME_UNKNOWN

    claims.release(claimed, user=ada)
    resumed = run_as(TEST_LOGINS["reconciler"], pass_once)
    assert resumed["taken"] == claimed.operation_id, resumed
    assert resumed["log"] == ""
