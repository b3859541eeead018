"""Execution state for desk tests, made through the ledger API (never as raw rows)."""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from ledger import episodes, facts, leases, obligations, runs
from ledger.models import FactConflict
from tests.factories import OperationFactory


def make_conflict(subject="invoice:42", *, tenant="default", run=None,
                  current=None, candidate=None, current_source="billing-agent",
                  candidate_source="bank-feed") -> FactConflict:
    """Version 1 from one source, then a different value from another that does not name
    version 1: an open conflict. On a leased run, both writes carry the lease's token."""
    token = leases.current_token(run.lease_resource) if run is not None else None
    facts.assert_fact(subject, "status", {"paid": False} if current is None else current,
                      source=current_source, tenant=tenant, run=run, fencing_token=token)
    kept = facts.assert_fact(subject, "status", {"paid": True} if candidate is None else candidate,
                             source=candidate_source, tenant=tenant, run=run,
                             fencing_token=token)
    assert kept.is_candidate
    return FactConflict.objects.get(candidate=kept)


def make_overdue(run, key="email:welcome:7", *, hours_late=3, kind="email.send"):
    """An obligation past its deadline; on a leased run, opened with the lease's token."""
    token = leases.current_token(run.lease_resource)
    return obligations.open(run, kind, key, fencing_token=token,
                            deadline=timezone.now() - timedelta(hours=hours_late))


def busy_run(run_id="run-ship-7", *, tenant="default", extra_rows=0):
    """A run with steps (one depending on another), operations, obligations (open, overdue,
    committed), facts, an episode and its lease; `extra_rows` more of each list."""
    run = runs.start("Ship order 7 once the payment clears", tenant=tenant, run_id=run_id)
    runs.add_step(run, "pay")
    runs.add_step(run, "ship", depends_on=["pay"])
    runs.commit_step(run, "pay")
    paid = OperationFactory(state="succeeded", run=run, step="pay", tenant=tenant,
                            operation="payments.capture")
    shipping = OperationFactory(state="outcome_unknown", run=run, step="ship", tenant=tenant,
                                operation="shipping.book")
    make_overdue(run, key=f"{run_id}:email")
    obligations.open(run, "invoice.send", f"{run_id}:invoice")
    obligations.commit(f"{run_id}:invoice", {"invoice": "INV-7"})
    facts.assert_fact("order:7", "payment", {"cleared": True}, source="bank-feed",
                      tenant=tenant, run=run)
    episodes.record(run, "assistant", content="Payment cleared; booking the courier next.")
    for n in range(extra_rows):
        OperationFactory(state="submitted", run=run, tenant=tenant)
        obligations.open(run, "note", f"{run_id}:note:{n}")
        facts.assert_fact(f"order:7:line:{n}", "packed", True, source="warehouse",
                          tenant=tenant, run=run)
        episodes.record(run, "tool", content=f"packed line {n}")
    token = leases.acquire(run.lease_resource, "worker-a", timedelta(minutes=5))
    return run, {"paid": paid, "shipping": shipping, "token": token}
