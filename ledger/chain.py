"""Tamper evidence: per-tenant hash chains over the audit trail.

Each link's hash is `sha256(canonical_json({"body": payload, "prev": <previous hash>,
"seq": <n>}))`, hex. `link(chain, tenant, payload)` appends one link in the caller's
transaction: a single upsert on the chain's `ChainHead` row takes the row lock (so
concurrent writers of one tenant take turns and never fork the chain), advances `seq` and
computes the hash in PostgreSQL (`hash_sql`) from the head's previous hash, in one round
trip. The caller stores the returned seq and hash on its own row. An operation's event
makes the same upsert a CTE of the statement that writes it (`ledger.transitions`).

A chain is registered in `CHAINS` with the model that carries it and the function that
rebuilds a row's payload; `verify` walks every registered chain. Operation events are the
first; human decisions on facts register the same way. A purge that deletes links writes a
`ChainAnchor` (seq, hash) for the last deleted link of each gap, so the rest still verifies.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from django.db import connection, transaction
from django.db.models import Model, QuerySet
from django.utils import timezone

from ledger.canonical import canonical_json
from ledger.models import AuditVerification, ChainAnchor, ChainHead

GENESIS = "0" * 64


def hash_sql(body: str, prev: str, seq: str) -> str:
    """The SQL expression of a link's hash: what `link_hash` computes in Python.

    Its arguments are SQL expressions: the payload's canonical JSON text, the previous
    link's hash and the link's seq. The writers of links (`link` here, and the statements
    of `ledger.transitions`) compute every hash with it, inside PostgreSQL.
    """
    return (
        "encode(sha256(convert_to('{\"body\":' || " + body + " || ',\"prev\":\"' || " + prev
        + " || '\",\"seq\":' || (" + seq + ")::text || '}', 'UTF8')), 'hex')"
    )


# The next link of one chain: a new head at seq 1 after the genesis hash, or the head
# advanced by one. The upsert locks the head row until the transaction ends.
_LINK = f"""
    INSERT INTO ledger_chainhead AS head (chain, tenant, seq, hash)
    VALUES (%(chain)s, %(tenant)s, 1, {hash_sql("%(body)s", f"'{GENESIS}'", "1")})
    ON CONFLICT (chain, tenant) DO UPDATE
       SET seq = head.seq + 1, hash = {hash_sql("%(body)s", "head.hash", "head.seq + 1")}
    RETURNING seq, hash
"""


@dataclass(frozen=True)
class Link:
    seq: int
    hash: str


def link(chain: str, tenant: str, payload: dict[str, Any]) -> Link:
    """Append `payload` as the next link of `chain` for `tenant`; call inside a transaction.

    The head row stays locked until the caller commits, so appends of one tenant are
    serialized; other tenants never wait. `payload` must be what `CHAINS[chain].payload`
    rebuilds from the stored row, or verification will report the link as broken.
    (An operation's event links its chain in the statement that writes it: see
    `ledger.transitions`.)
    """
    if not connection.in_atomic_block:
        raise RuntimeError("expected chain.link inside the writer's transaction, found none")
    with connection.cursor() as cursor:
        cursor.execute(_LINK, {"chain": chain, "tenant": tenant, "body": link_body(payload)})
        seq, digest = cursor.fetchone()
    return Link(seq=seq, hash=digest)


def link_body(payload: dict[str, Any]) -> str:
    """The text a link's hash covers for `payload`: its canonical JSON, as jsonb reads back."""
    return canonical_json(normalize(payload))


def link_hash(payload: dict[str, Any], *, prev: str, seq: int) -> str:
    """The hash `link` computes, in Python: what verification expects."""
    material = canonical_json({"body": normalize(payload), "prev": prev, "seq": seq})
    return hashlib.sha256(material.encode("utf-8")).hexdigest()


def normalize(value: Any) -> Any:
    """`value` as it reads back from a jsonb column, so a stored row rehashes the same.

    jsonb keeps numbers as exact decimals: a float written in exponent form (1e+20) reads
    back as an integer, and -0.0 as 0.0. Everything else (objects, lists, strings, other
    floats) survives the round trip unchanged.
    """
    if isinstance(value, float) and math.isfinite(value):
        if "e+" in repr(value):
            return int(Decimal(repr(value)))
        return value + 0.0  # -0.0 reads back as 0.0
    if isinstance(value, dict):
        return {key: normalize(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [normalize(item) for item in value]
    return value


def timestamp(value: datetime) -> str:
    return value.astimezone(UTC).isoformat()


# --- registered chains ------------------------------------------------------------------


@dataclass(frozen=True)
class ChainSpec:
    """How to walk one chain: its rows in seq order per tenant and how to rebuild payloads."""

    name: str
    rows: Callable[[], QuerySet]  # every chained row, any order; verify orders them
    payload: Callable[[Model], dict[str, Any]]
    describe: Callable[[Model], dict[str, Any]]  # ids that name a broken link
    seq_field: str = "chain_seq"
    hash_field: str = "chain_hash"


CHAINS: dict[str, ChainSpec] = {}


def register(spec: ChainSpec) -> ChainSpec:
    CHAINS[spec.name] = spec
    return spec


def _event_rows():
    from django.db.models import F

    from ledger.models import OperationEvent

    return OperationEvent.objects.annotate(operation_ref=F("operation__operation_id"))


def operation_event_payload(event) -> dict[str, Any]:
    """The content of one OperationEvent that its chain hash covers."""
    return {
        "kind": "operation_event",
        "tenant": event.tenant,
        "operation": event.operation_ref,
        "version": event.version,
        "from_state": event.from_state,
        "to_state": event.to_state,
        "actor_kind": event.actor_kind,
        "actor_id": event.actor_id,
        "reason": event.reason,
        "evidence": event.evidence,
        "fencing_token": event.fencing_token,
        "created_at": timestamp(event.created_at),
    }


OPERATION_EVENTS = register(
    ChainSpec(
        name="operation_events",
        rows=_event_rows,
        payload=operation_event_payload,
        describe=lambda event: {"event_id": event.pk, "operation_id": event.operation_ref},
    )
)


def fact_decision_payload(decision) -> dict[str, Any]:
    """The content of one FactDecision that its chain hash covers (facts never change)."""
    return {
        "kind": "fact_decision",
        "tenant": decision.tenant,
        "conflict": decision.conflict_id,
        "chosen": decision.chosen_id,
        "written": decision.written_id,
        "username": decision.username,
        "reason": decision.reason,
        "created_at": timestamp(decision.created_at),
    }


def _decision_rows():
    from ledger.models import FactDecision

    return FactDecision.objects.all()


FACT_DECISIONS = register(
    ChainSpec(
        name="fact_decisions",
        rows=_decision_rows,
        payload=fact_decision_payload,
        describe=lambda decision: {"fact_decision_id": decision.pk,
                                   "conflict_id": decision.conflict_id},
    )
)


# --- verification -----------------------------------------------------------------------


@dataclass
class Break:
    chain: str
    tenant: str
    seq: int
    expected: str
    found: str
    message: str
    ids: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {"chain": self.chain, "tenant": self.tenant, "seq": self.seq,
                "expected": self.expected, "found": self.found, "message": self.message,
                **self.ids}


@dataclass
class Verification:
    record: AuditVerification
    first_break: Break | None

    @property
    def is_intact(self) -> bool:
        return self.first_break is None


def verify(*, actor: str, progress: Callable[[str], None] | None = None) -> Verification:
    """Walk every chain of every tenant; record and return the first broken link, if any.

    A link is broken when its stored hash differs from the hash rebuilt from its row and
    the previous link (an event or, after a purge, an anchor), when a seq has neither an
    event nor an anchor before it, or when the chain head is not the last link. Never
    changes a chained row.
    """
    started = timezone.now()
    checked = 0
    first_break: Break | None = None
    heads = []
    for head in ChainHead.objects.order_by("chain", "tenant"):
        spec = CHAINS.get(head.chain)
        if spec is None:
            continue
        count, found = _verify_one(spec, head)
        checked += count
        heads.append({"chain": head.chain, "tenant": head.tenant, "seq": head.seq,
                      "hash": head.hash, "links_checked": count, "is_intact": found is None})
        if progress:
            progress(f"{head.chain}/{head.tenant}: {count} links, "
                     f"{'intact' if found is None else 'BROKEN'}")
        if found is not None and first_break is None:
            first_break = found
    with transaction.atomic(durable=True):
        record = AuditVerification.objects.create(
            actor=actor[:200], started_at=started, finished_at=timezone.now(),
            links_checked=checked, is_intact=first_break is None,
            first_break=first_break.as_dict() if first_break else None, heads=heads,
        )
    return Verification(record=record, first_break=first_break)


def _verify_one(spec: ChainSpec, head: ChainHead) -> tuple[int, Break | None]:
    anchors = dict(
        ChainAnchor.objects.filter(chain=spec.name, tenant=head.tenant)
        .values_list("seq", "hash")
    )
    prev_seq, prev_hash = 0, GENESIS
    checked = 0
    for row in _rows_in_order(spec, head.tenant):
        seq, stored = getattr(row, spec.seq_field), getattr(row, spec.hash_field)
        checked += 1
        if seq != prev_seq + 1:
            if seq - 1 not in anchors:
                return checked, Break(
                    spec.name, head.tenant, seq, expected=f"a link or purge anchor at {seq - 1}",
                    found=f"the previous link at {prev_seq}",
                    message=f"link {seq - 1} is missing and no purge anchor replaces it",
                    ids=spec.describe(row),
                )
            prev_hash = anchors[seq - 1]
        expected = link_hash(spec.payload(row), prev=prev_hash, seq=seq)
        if expected != stored:
            return checked, Break(
                spec.name, head.tenant, seq, expected=expected, found=stored,
                message="the stored hash does not match the row and the previous link",
                ids=spec.describe(row),
            )
        prev_seq, prev_hash = seq, stored
    if head.seq != prev_seq:
        if head.seq in anchors and anchors[head.seq] == head.hash and head.seq > prev_seq:
            return checked, None
        return checked, Break(
            spec.name, head.tenant, head.seq, expected=f"{head.seq}:{head.hash}",
            found=f"{prev_seq}:{prev_hash}",
            message="the chain head is not the last link: links after it are missing",
            ids={},
        )
    if head.hash != prev_hash:
        return checked, Break(
            spec.name, head.tenant, head.seq, expected=head.hash, found=prev_hash,
            message="the last link's hash differs from the chain head", ids={},
        )
    return checked, None


def _rows_in_order(spec: ChainSpec, tenant: str) -> Iterator[Model]:
    return (
        spec.rows().filter(tenant=tenant).order_by(spec.seq_field).iterator(chunk_size=2000)
    )
