"""The one writer of OperationEvent rows.

Every transition of an operation appends exactly one event here, in the caller's
transaction, linked into its tenant's hash chain (`ledger.chain`). Evidence and reasons are
agent- or person-written: secrets are masked before they are stored.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from ledger import chain
from ledger.canonical import check_json, redact, scrub_text
from ledger.models import Operation, OperationEvent


def append_operation_event(
    op: Operation,
    *,
    from_state: str,
    to_state: str,
    version: int,
    actor_kind: str,
    actor_id: str = "",
    reason: str = "",
    evidence: Any = None,
    fencing_token: int | None = None,
    now: datetime,
) -> OperationEvent:
    """Append the event, chained after the tenant's last one; inside the caller's transaction.

    The chain head of the tenant stays locked until that transaction ends, so concurrent
    writers of one tenant are serialized; keep the transaction short.
    """
    if evidence is not None:
        check_json(evidence, what="evidence")
        evidence = chain.normalize(redact(evidence))
    event = OperationEvent(
        operation=op,
        tenant=op.tenant,
        version=version,
        from_state=from_state,
        to_state=to_state,
        actor_kind=actor_kind,
        actor_id=actor_id[:200],
        reason=scrub_text(reason),
        evidence=evidence,
        fencing_token=fencing_token,
        created_at=now,
    )
    event.operation_ref = op.operation_id
    payload = chain.operation_event_payload(event)
    linked = chain.link(chain.OPERATION_EVENTS.name, op.tenant, payload)
    event.chain_seq, event.chain_hash = linked.seq, linked.hash
    event.save(force_insert=True)
    return event
