"""The demo seed tells a history with realistic ages, and leaves the audit chain verified."""

import io
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.utils import timezone

from ledger import chain, selectors
from ledger.models import AuditVerification, Operation, OperationEvent
from ledger.states import State
from tests.factories import UserFactory


@pytest.mark.django_db(transaction=True)
def test_the_demo_seed_spreads_ages_from_minutes_to_days_and_leaves_a_verified_chain(client):
    out = io.StringIO()
    call_command("demo_seed", stdout=out)
    now = timezone.now()

    # Waiting items have waited from minutes to days.
    waited = [now - at for at in Operation.objects.filter(
        state__in=selectors.QUEUE_STATES).values_list("state_changed_at", flat=True)]
    assert min(waited) < timedelta(minutes=30)
    assert max(waited) > timedelta(days=4)
    assert any(timedelta(hours=1) < age < timedelta(days=1) for age in waited)

    # So the desk's "stuck" filters find something.
    reviewer = UserFactory(username="ages-reviewer", role="reviewer",
                           tenants=["default", "acme"])
    stuck = selectors.review_queue(reviewer, selectors.QueueFilters(
        older_than=timedelta(hours=1)))
    assert len(stuck.items) >= 4
    submitted = selectors.review_queue(reviewer, selectors.QueueFilters(
        state=State.SUBMITTED, older_than=timedelta(hours=1)))
    assert [op.intent["title"] for op in submitted.items] == ["Evening briefing"]
    waiting_for_agent = selectors.review_queue(reviewer, selectors.QueueFilters(
        state=State.SAFE_TO_RETRY, older_than=timedelta(days=1)))
    assert len(waiting_for_agent.items) >= 2
    assert len(selectors.awaiting_page(reviewer).items) == 1

    # Each tenant's chain moves forward in time: chapters were written oldest first.
    for tenant in ("default", "acme"):
        times = list(OperationEvent.objects.filter(tenant=tenant)
                     .order_by("chain_seq").values_list("created_at", flat=True))
        assert times and times == sorted(times)
        assert now - times[0] > timedelta(days=5)

    # The seed verified the chain it wrote; the audit page shows that, and it still holds.
    assert "Audit chain verified by demo_seed" in out.getvalue() and "intact" in out.getvalue()
    record = AuditVerification.objects.get(actor="demo_seed")
    assert record.is_intact and record.links_checked > 50
    client.force_login(reviewer)
    audit = client.get("/audit/").content.decode()
    assert "Never verified" not in audit and "by demo_seed" in audit
    assert chain.verify(actor="test").is_intact
