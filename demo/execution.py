"""Demo execution state: runs with steps, facts (one conflict per tenant), obligations (one
overdue per tenant), an operation in flight and a few episodes. Safe to run twice: every
write goes through the idempotent ledger API, or is skipped when already there."""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from ledger import episodes, facts, obligations, receipts, runs
from ledger.models import Episode, Obligation, ObligationState, StepState


def seed_execution(stdout) -> None:
    """Create (or complete) the demo runs and say what is there."""
    now = timezone.now()
    _ship_order(now)
    _refund_invoice()
    _acme_sync(now)
    stdout.write("Demo execution state:")
    for run_id in ("demo-ship-order-1042", "demo-refund-2291", "demo-acme-crm-sync"):
        view = runs.hand_off(run_id)
        steps = ", ".join(f"{s.step_id} {s.state}" for s in view.steps)
        stdout.write(f"  {run_id:<22} {view.run.tenant:<8} steps: {steps}")
    overdue = obligations.overdue().count()
    conflicts = facts.open_conflicts().count()
    stdout.write(f"  {conflicts} open fact conflict(s), {overdue} overdue obligation(s)")


def _ship_order(now) -> None:
    run = runs.start("Ship order 1042 once the payment clears", run_id="demo-ship-order-1042")
    _steps(run, [("charge-card", (), StepState.COMMITTED),
                 ("reserve-stock", (), StepState.COMMITTED),
                 ("ship", ("charge-card", "reserve-stock"), StepState.STARTED),
                 ("email-customer", ("ship",), StepState.PENDING)])
    _facts_once("order:1042", "status", run, [("paid", "payments-api"),
                                               ("ready to ship", "warehouse")])
    _facts_once("order:1042", "address", run, [("12 Elm Street, Springfield", "crm")])
    # A second agent read an old copy of the address: kept as a candidate, for a person.
    facts.assert_fact("order:1042", "address", "14 Elm Street, Springfield",
                      source="support-agent", run=run)
    op = receipts.record_intent(
        "shipments.create", "https://wms.example/api/shipments",
        {"order": 1042, "carrier": "dhl"}, run=run, step="ship",
        idempotency_key=receipts.idempotency_key(run.run_id, "ship"),
    )
    if op.state == "planned":
        receipts.mark_submitted(op)
    obligations.open(run, "email.confirmation", "demo-confirm-order-1042",
                     deadline=now - timedelta(hours=3))
    obligations.open(run, "payment.capture", "demo-capture-order-1042")
    _commit_once("demo-capture-order-1042", {"capture_id": "cap_1042"})
    if not Episode.objects.filter(run=run).exists():
        episodes.record(run, "user", content="Please ship order 1042 to the customer.")
        episodes.record(run, "assistant", content="Payment captured; booking DHL.",
                        content_ref="transcripts/demo-ship-order-1042/2.json")


def _refund_invoice() -> None:
    run = runs.start("Refund invoice 2291 after verifying the complaint",
                     run_id="demo-refund-2291")
    _steps(run, [("verify-complaint", (), StepState.COMMITTED),
                 ("refund", ("verify-complaint",), StepState.COMMITTED)])
    _facts_once("invoice:2291", "status", run, [("open", "billing"),
                                                 ("refunded", "payments-api")])
    obligations.open(run, "payment.refund", "demo-refund-invoice-2291")
    _commit_once("demo-refund-invoice-2291", {"refund_id": "re_2291", "amount": "49.00"})


def _acme_sync(now) -> None:
    run = runs.start("Sync customer records into the CRM", tenant="acme",
                     run_id="demo-acme-crm-sync")
    _steps(run, [("export", (), StepState.COMMITTED),
                 ("import", ("export",), StepState.PENDING)])
    _facts_once("customer:77", "email", run, [("ana@acme.example", "crm")], tenant="acme")
    facts.assert_fact("customer:77", "email", "ana.lopez@acme.example", source="mail-import",
                      tenant="acme", run=run)
    obligations.open(run, "crm.import", "demo-acme-import-77",
                     deadline=now - timedelta(days=1))


def _steps(run, plan) -> None:
    for step_id, depends_on, state in plan:
        step = runs.add_step(run, step_id, depends_on=depends_on)
        if state == StepState.COMMITTED:
            runs.commit_step(run, step_id)
        elif state == StepState.STARTED and step.state == StepState.PENDING:
            runs.start_step(run, step_id)


def _facts_once(subject, predicate, run, versions, *, tenant="default") -> None:
    """Write the versions in order, unless the fact already has a history."""
    if facts.read_fact(subject, predicate, tenant=tenant) is not None:
        return
    expected = None
    for value, source in versions:
        fact = facts.assert_fact(subject, predicate, value, source=source, tenant=tenant,
                                 run=run, expected_version=expected)
        expected = fact.version


def _commit_once(key, result) -> None:
    if Obligation.objects.filter(key=key, state=ObligationState.OPEN).exists():
        obligations.commit(key, result)
