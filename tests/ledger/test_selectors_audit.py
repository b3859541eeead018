"""Reads of the audit trail: events of visible tenants, keyset export, chain status."""

import pytest

from ledger import chain, selectors
from ledger.models import ChainHead
from ledger.selectors.audit import AuditFilters, audit_events, audit_status, iter_audit_events
from ledger.states import State
from tests.factories import OperationFactory, UserFactory


@pytest.mark.django_db
def test_events_of_other_tenants_are_not_read_and_a_superuser_reads_all(reviewer):
    ours = OperationFactory(state=State.SUCCEEDED)
    theirs = OperationFactory(state=State.SUCCEEDED, tenant="acme")
    assert {e.operation_id for e in audit_events(reviewer)} == {ours.pk}
    nobody = UserFactory(username="nobody", role="viewer", tenants=[])
    assert list(audit_events(nobody)) == []
    root = UserFactory(username="root", is_superuser=True, tenants=[])
    assert {e.operation_id for e in audit_events(root)} == {ours.pk, theirs.pk}


@pytest.mark.django_db
def test_the_export_reads_every_matching_event_in_batches_newest_first(reviewer):
    for _ in range(3):
        OperationFactory(state=State.SUCCEEDED)
    expected = list(audit_events(reviewer))
    assert len(expected) == 9
    assert list(iter_audit_events(reviewer, batch=2)) == expected
    only_done = list(iter_audit_events(reviewer, AuditFilters(state=State.SUCCEEDED), batch=2))
    assert [e.to_state for e in only_done] == [State.SUCCEEDED] * 3


@pytest.mark.django_db
def test_chain_status_shows_the_heads_of_visible_tenants_only(reviewer):
    OperationFactory(state=State.SUCCEEDED)
    OperationFactory(state=State.SUCCEEDED, tenant="acme")
    chain.verify(actor="nightly")
    # The records chain of default holds the reviewer's tenant grant.
    assert sorted((h["chain"], h["tenant"]) for h in audit_status()["heads"]) == [
        ("operation_events", "acme"), ("operation_events", "default"), ("records", "default")]
    assert [h["tenant"] for h in audit_status(tenants={"acme"})["heads"]] == ["acme"]
    status = selectors.audit_status_for(reviewer)
    records = ChainHead.objects.get(chain="records", tenant="default").seq
    assert [(h.chain, h.tenant, h.seq, h.verified_seq) for h in status.heads] == [
        ("operation_events", "default", 3, 3), ("records", "default", records, records)]
    assert (status.is_intact, status.links_checked) == (True, 3 + records)
    nobody = UserFactory(username="nobody", role="viewer", tenants=[])
    assert selectors.audit_status_for(nobody).heads == []
