"""The audit log page and its CSV export."""

import csv
import io
from datetime import timedelta

import pytest
from django.db import connection
from django.urls import reverse
from django.utils import timezone

from ledger import chain, receipts, selectors
from ledger.models import OperationEvent
from ledger.states import State
from review.views import csv_safe
from tests.factories import OperationFactory

AUDIT = reverse("review:audit")
EXPORT = reverse("review:audit_csv")


def exported(client, **params):
    response = client.get(EXPORT, params)
    assert response.status_code == 200 and response.streaming
    assert response["Content-Type"].startswith("text/csv")
    return list(csv.reader(io.StringIO(b"".join(response.streaming_content).decode())))


@pytest.mark.django_db
def test_audit_log_lists_human_decisions_and_machine_transitions(client, reviewer):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    receipts.resolve(op, State.ABANDONED, user=reviewer, reason="the CMS was wiped")
    client.force_login(reviewer)
    body = client.get(AUDIT).content.decode()
    assert "the CMS was wiped" in body and "test setup: to outcome_unknown" in body
    assert body.count(op.operation_id) >= 4


@pytest.mark.django_db
def test_audit_filters_by_user_operation_state_and_time(client, reviewer):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN, operation="emails.send")
    other = OperationFactory(state=State.MANUAL_REVIEW)
    receipts.resolve(op, State.SUCCEEDED, user=reviewer, reason="delivered")
    client.force_login(reviewer)

    def rows(**params):
        return list(client.get(AUDIT, params).context["page"].items)

    assert [e.reason for e in rows(actor="reviewer")] == ["delivered"]
    assert {e.operation_id for e in rows(operation=op.operation_id)} == {op.pk}
    assert {e.operation_id for e in rows(operation="emails.send")} == {op.pk}
    assert {e.operation_id for e in rows(state="manual_review")} == {other.pk}
    today = timezone.now().date()
    yesterday, tomorrow = today - timedelta(days=1), today + timedelta(days=1)
    assert len(rows(since=yesterday.isoformat(), until=tomorrow.isoformat())) == 9
    assert rows(since=(tomorrow + timedelta(days=1)).isoformat()) == []
    assert rows(until=(yesterday - timedelta(days=1)).isoformat()) == []


@pytest.mark.django_db
def test_audit_log_shows_only_granted_tenants(client, reviewer):
    theirs = OperationFactory(state=State.OUTCOME_UNKNOWN, tenant="acme")
    client.force_login(reviewer)
    assert theirs.operation_id not in client.get(AUDIT).content.decode()
    assert all(row[1] != theirs.operation_id for row in exported(client))


@pytest.mark.django_db
def test_audit_keyset_pages_cover_every_event_once(reviewer):
    for _ in range(4):
        OperationFactory(state=State.SUBMITTED)  # two events each
    seen, cursor = [], ""
    while True:
        page = selectors.audit_page(reviewer, cursor=cursor, per_page=3)
        seen += [event.pk for event in page.items]
        if not page.next_cursor:
            break
        cursor = page.next_cursor
    assert len(seen) == len(set(seen)) == 8


@pytest.mark.django_db
@pytest.mark.parametrize("per_page", [1, 50])
def test_audit_page_runs_a_fixed_number_of_queries(client, reviewer, per_page,
                                                   django_assert_num_queries):
    for _ in range(20):
        OperationFactory(state=State.OUTCOME_UNKNOWN)
    client.force_login(reviewer)
    chain.verify(actor="nightly")
    # session, user, user perms, group perms, tenant grants, the page (events + operations),
    # chain heads, last verification (these two added with the chain status: 6 -> 8), the
    # unsealed tail (with the sealer: 9)
    with django_assert_num_queries(9):
        response = client.get(AUDIT, {"per_page": per_page})
    assert len(response.context["page"].items) == per_page


@pytest.mark.django_db
def test_csv_export_holds_every_filtered_event_across_batches(client, reviewer):
    ops = [OperationFactory(state=State.SUBMITTED) for _ in range(3)]
    client.force_login(reviewer)
    rows = exported(client)
    assert rows[0][:3] == ["time", "operation_id", "tenant"]
    assert len(rows) == 1 + 6
    assert {row[1] for row in rows[1:]} == {op.operation_id for op in ops}
    assert len(list(selectors.iter_audit_events(reviewer, batch=4))) == 6
    only_one = exported(client, operation=ops[0].operation_id)
    assert {row[1] for row in only_one[1:]} == {ops[0].operation_id}


@pytest.mark.django_db
def test_csv_export_neutralises_spreadsheet_formulas(client, reviewer):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    receipts.resolve(op, State.ABANDONED, user=reviewer, reason='=HYPERLINK("http://x","y")')
    client.force_login(reviewer)
    [row] = [r for r in exported(client) if r[6] == "abandoned"]
    assert row[9] == "'=HYPERLINK(\"http://x\",\"y\")"
    assert [csv_safe(v) for v in ("+1", "-2", "@SUM(A1)", "\tx", "plain", 3)] == [
        "'+1", "'-2", "'@SUM(A1)", "'\tx", "plain", "3"]


@pytest.mark.django_db
def test_htmx_request_gets_only_the_audit_results_fragment(client, reviewer):
    OperationFactory(state=State.SUBMITTED)
    client.force_login(reviewer)
    body = client.get(AUDIT, headers={"HX-Request": "true"}).content.decode()
    assert body.lstrip().startswith('<section id="results"') and "<html" not in body


# --- the hash chain's status ----------------------------------------------------------------


@pytest.mark.django_db
def test_audit_page_shows_the_chain_heads_of_visible_tenants_and_the_last_verification(
        client, reviewer):
    OperationFactory(state=State.SUCCEEDED)
    OperationFactory(state=State.SUCCEEDED, tenant="acme")
    chain.verify(actor="nightly-verify")
    OperationFactory(state=State.SUBMITTED)  # two links newer than the verification
    chain.seal()
    client.force_login(reviewer)
    response = client.get(AUDIT)
    status = response.context["chain_status"]
    # The operation events' chain, and the records chain (the reviewer's tenant grant).
    [head, records] = status.heads
    assert (head.chain, head.tenant, head.seq, head.verified_seq) == (
        "operation_events", "default", 5, 3)
    assert (records.chain, records.tenant, records.verified_seq) == ("records", "default",
                                                                     records.seq)
    assert (status.is_intact, status.links_checked) == (True, 3 + records.seq)
    body = response.content.decode()
    assert f"{head.hash[:12]}…" in body and "nightly-verify" in body and "intact" in body
    assert "2 newer links" in body
    acme_head = selectors.audit_status()["heads"]
    assert any(h["tenant"] == "acme" for h in acme_head)
    assert all(h["hash"][:12] not in body for h in acme_head if h["tenant"] == "acme")


@pytest.mark.django_db
def test_audit_page_says_when_the_chain_was_never_verified(client, reviewer):
    OperationFactory(state=State.SUBMITTED)
    client.force_login(reviewer)
    body = client.get(AUDIT).content.decode()
    assert "Never verified" in body and "No chain yet" in body
    assert "default: 2 events, the oldest committed" in body  # the unsealed tail
    chain.seal()
    body = client.get(AUDIT).content.decode()
    assert "Never verified" in body and "not verified yet" in body
    assert "None: every committed event is sealed." in body


def tamper_with(event):
    """Rewrite an event as a superuser would, with the triggers off."""
    with connection.cursor() as cursor:
        cursor.execute("SET session_replication_role = replica")
        OperationEvent.objects.filter(pk=event.pk).update(reason="nothing happened")
        cursor.execute("RESET session_replication_role")


@pytest.mark.django_db
def test_audit_page_names_the_first_broken_link_only_to_who_may_see_its_tenant(
        client, reviewer, other_tenant_reviewer):
    OperationFactory(state=State.SUCCEEDED, tenant="acme")
    victim = OperationFactory(state=State.SUCCEEDED)
    chain.seal()
    tamper_with(OperationEvent.objects.filter(operation=victim).order_by("version")[1])
    assert not chain.verify(actor="nightly").is_intact

    client.force_login(reviewer)
    body = client.get(AUDIT).content.decode()
    assert "broken" in body and "First broken link" in body
    assert "operation_events/default</span> at seq 2" in body and victim.operation_id in body

    client.force_login(other_tenant_reviewer)
    response = client.get(AUDIT)
    body = response.content.decode()
    assert response.context["chain_status"].is_intact is True
    assert "First broken link" not in body and victim.operation_id not in body
