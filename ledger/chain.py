"""Tamper evidence: per-tenant hash chains over the audit trail.

Each link's hash is `sha256(canonical_json({"body": payload, "prev": <previous hash>,
"seq": <n>}))`, hex. Two ways to append:

- Operation events, the write path of every agent, are written unsealed (`chain_seq` and
  `chain_hash` NULL) and linked after their commit by the sealer, `seal()`: it takes a
  tenant's committed, unsealed events in id order, computes their links from the stored rows
  (what verification rebuilds) and sets them through the database function
  `ledger_seal_events`, which moves the head from where the sealer linked from (two sealers
  never fork a chain) and sets each event's link once; nothing else may (migration 0025).
  So writers of one tenant never wait for each other's commits; the chain trails them by
  the sealer's interval (`manage.py seal`, and a thread of `manage.py reconcile`), and
  `unsealed()` says by how much (the audit page, /healthz and /metrics show it). Until it
  is sealed an event is protected by the append-only triggers alone, as every row is; from
  then on by the chain too. An operation with an unsealed event is not purged.
- Human decisions on facts (`FactDecision`, chain "fact_decisions") and the record links
  of the rows people rely on (`RecordLink`, chain "records": approvals, notes, tenant grants
  and their log, facts, ...; written by PostgreSQL's trigger `ledger_record_link` alone,
  see `ledger.chain_content`) are written unsealed too and linked by the same sealer,
  through `ledger_seal_links` (migration 0049): their `chain_seq` and `chain_hash` are never
  the writer's. (`link(chain, tenant, payload)` still appends a link in the writer's
  transaction, as the tables' owner only, since no role may write a chain head; no chain
  of the ledger uses it.)

A chain is registered in `CHAINS` with the model that carries it and the function that
rebuilds a row's payload; `verify` walks every registered chain (operation events, fact
decisions, records), then holds every row of the record sources to its latest link. A
purge that deletes links writes a `ChainAnchor` (seq, hash) for the last deleted link of
each gap, so the rest still verifies.

What an operation event's link covers has a format (`OperationEvent.chain_format`):
format 1 the transition alone; format 2 also the operation's `external_id` after the move,
the deciding user of a person's event (`decided_by`) and the seal of the `Evidence` row the
reconciler wrote with it (`evidence_seal`: the row's digest, so the row itself cannot be
rewritten unseen; retention's redaction of its payloads is accounted for); format 3 also
the operation's identity and content as of the event (`content`: target, the digests of its
intent and result, fingerprint, key, retry policy); format 4 (every event
written from migration 0043) every other column of the operation in `content` too
(`ledger.chain_content.FORMAT_4_COLUMNS`: name, tenant, run, step, relies_on, attempt,
its times, error code and detail, conflict, trace and span ids, ...); format 5
(`CURRENT_FORMAT`, from migration 0052) also the provider account the call acts as
(`FORMAT_5_COLUMNS`). PostgreSQL sets an
event's format and computes its content from the row the event's own statement wrote
(trigger `event_chain_columns`), whatever the writer sent. Old events keep verifying the
way they were written; a link of an older format after a newer one is a break.

`verify` checks, besides every link:
- the chain heads recorded by earlier intact verifications, and any heads the caller
  expects (`manage.py verify_audit --expect-head FILE`, kept where the database owner
  cannot reach them): a chain shorter than recorded, or whose link at a recorded seq has
  another hash, was truncated or rewritten;
- every Evidence row against the event that sealed it (format 2), or, written before
  format 2, its verdict against the reconciler's event; a row no event accounts for, or a
  sealed row that is gone, is a break;
- every operation row's state, version, (format 2) external_id and (format 3 and 4)
  content against its last event; every row that differs is reported (`Verification.differing`),
  by operation id and what differs. An intent retention redacted (the operation's
  `redacted_at`, its marker, and the `Redaction` row recording it) is held to nothing
  more: its digest is gone with it, as is its error detail's. The duplicate mark another
  operation's success sets (a succeeded twin exists) is held to nothing more either.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from django.db import DatabaseError, connection, transaction
from django.db.models import Model, QuerySet
from django.utils import timezone

from ledger.canonical import REDACTED, canonical_json
from ledger.chain_content import CURRENT_FORMAT as CURRENT_FORMAT
from ledger.chain_content import DIGESTS, RECORD_SOURCES, digest_sql, record_content_sql
from ledger.chain_content import content_sql as content_sql
from ledger.models import AuditVerification, ChainAnchor, ChainHead
from ledger.states import ActorKind

logger = logging.getLogger("ledger.chain")

GENESIS = "0" * 64
# CURRENT_FORMAT, the format every operation event is written in now, and content_sql,
# what its link covers of its operation: PostgreSQL sets both on every event
# (ledger.chain_content); re-exported here.
_digest_sql = digest_sql

# The columns `content_sql` reads (the statements of ledger.transitions return them).
CONTENT_COLUMNS = ("target", "intent", "intent_fingerprint", "idempotency_key", "retry_policy",
                   "result")


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


# --- the sealer ------------------------------------------------------------------------------

# Events linked per transaction: a batch is one function call (and one UPDATE of its rows).
SEAL_BATCH = 1000


def seal_lock_name(tenant: str, chain: str = "operation_events") -> str:
    """The worker's lock a sealer takes per chain and tenant (`ledger_worker_lock`, a row
    lock only the reconciler's role may take): a second sealer skips the tenant rather than
    wait (its work would be refused), and no agent's or person's login can hold it to stall
    the sealer."""
    return f"seal:{tenant}" if chain == "operation_events" else f"seal:{chain}:{tenant}"


def seal(*, tenant: str | None = None, limit: int = SEAL_BATCH) -> int:
    """Link every committed, unsealed row of every sealed chain (operation events, fact
    decisions, records) into its tenant's chain; the count of rows linked.

    Per chain and tenant, batches of `limit` rows in id order, each in its own transaction
    (a savepoint inside a caller's): a crash mid-batch leaves that batch unsealed, the earlier
    ones sealed, the chain intact. Each tenant is sealed in isolation: a tenant whose batch
    fails (say a link PostgreSQL refuses) is logged and left for the next sweep, and the
    other tenants are sealed all the same. A tenant another sealer is working on is
    skipped. Call outside a transaction to see what other sessions committed meanwhile.
    """
    if limit < 1:
        raise ValueError(f"expected a batch limit of at least 1, found {limit}")
    sealed = 0
    for spec in SEALED_CHAINS:
        for name in [tenant] if tenant is not None else _unsealed_tenants(spec):
            try:
                while True:
                    count = _seal_batch(spec, name, limit)
                    sealed += count
                    if count < limit:
                        break
            except Exception as exc:  # one tenant's failure never holds another's
                logger.error("sealing tenant %r failed; its unsealed events wait for the next "
                             "sweep, the other tenants are sealed: %s: %s", name,
                             type(exc).__name__, str(exc).strip(),
                             exc_info=not isinstance(exc, DatabaseError))
    return sealed


def _unsealed_tenants(spec: ChainSpec) -> list[str]:
    # A loose index scan of the partial index of unsealed rows: one probe per tenant.
    table = spec.rows().model._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(f"""
            WITH RECURSIVE t(tenant) AS (
                SELECT min(tenant) FROM {table} WHERE chain_seq IS NULL
                UNION ALL
                SELECT (SELECT min(e.tenant) FROM {table} e
                         WHERE e.chain_seq IS NULL AND e.tenant > t.tenant)
                  FROM t WHERE t.tenant IS NOT NULL)
            SELECT tenant FROM t WHERE tenant IS NOT NULL
        """)
        return [row[0] for row in cursor.fetchall()]


def _lock_tenant(tenant: str, chain: str = "operation_events") -> bool:
    """Take the sealer's lock of `tenant`'s `chain` for the transaction, without waiting;
    whether it was taken (another sealer holds it: skip the tenant). The one place the lock
    is taken."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT ledger_worker_lock(%s)", [seal_lock_name(tenant, chain)])
        return cursor.fetchone()[0]


def _seal_batch(spec: ChainSpec, tenant: str, limit: int) -> int:
    with transaction.atomic():
        if not _lock_tenant(tenant, spec.name):
            return 0
        head = (ChainHead.objects.filter(chain=spec.name, tenant=tenant)
                .values_list("seq", "hash").first()) or (0, GENESIS)
        rows = list(spec.rows().filter(tenant=tenant, chain_seq__isnull=True)
                    .order_by("id")[:limit])
        if not rows:
            return 0
        seq, prev = head
        hashes = []
        for row in rows:
            seq += 1
            prev = link_hash(spec.payload(row), prev=prev, seq=seq)
            hashes.append(prev)
        ids = [row.pk for row in rows]
        with connection.cursor() as cursor:
            if spec.name == "operation_events":
                cursor.execute("SELECT ledger_seal_events(%s, %s, %s, %s, %s)",
                               [tenant, ids, hashes, head[0], head[1]])
            else:
                cursor.execute("SELECT ledger_seal_links(%s, %s, %s, %s, %s, %s)",
                               [spec.name, tenant, ids, hashes, head[0], head[1]])
    return len(rows)


@dataclass(frozen=True)
class Unsealed:
    """The tail of one tenant's chain the sealer has not linked yet."""

    tenant: str
    events: int
    oldest_at: datetime

    def age_seconds(self, now: datetime) -> float:
        return max(0.0, (now - self.oldest_at).total_seconds())


def unsealed() -> list[Unsealed]:
    """Per tenant with committed events not yet sealed: how many, since when."""
    with connection.cursor() as cursor:
        cursor.execute("""
            SELECT tenant, count(*), min(created_at) FROM ledger_operationevent
             WHERE chain_seq IS NULL GROUP BY tenant ORDER BY tenant
        """)
        return [Unsealed(tenant, count, oldest) for tenant, count, oldest in cursor.fetchall()]


def seal_lag_seconds(now: datetime | None = None) -> float:
    """How long the oldest unsealed event has waited for the sealer (0 when none waits)."""
    now = now or timezone.now()
    return max((tail.age_seconds(now) for tail in unsealed()), default=0.0)


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
    # A format that only grows along the chain (what each link covers), if the chain has one.
    format_field: str | None = None


CHAINS: dict[str, ChainSpec] = {}


def register(spec: ChainSpec) -> ChainSpec:
    CHAINS[spec.name] = spec
    return spec


def _event_rows():
    from django.db.models import F

    from ledger.models import OperationEvent

    return OperationEvent.objects.annotate(operation_ref=F("operation__operation_id"))


def operation_event_payload(event) -> dict[str, Any]:
    """The content of one OperationEvent that its chain hash covers, by its chain_format."""
    payload = {
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
    # getattr: migration 0004 chained the events of its day with this, before the column.
    if getattr(event, "chain_format", 1) >= 2:
        payload.update(chain_format=event.chain_format, external_id=event.external_id,
                       evidence_seal=event.evidence_seal, decided_by=event.decided_by_id)
    if getattr(event, "chain_format", 1) >= 3:
        payload["content"] = event.content
    return payload


# --- evidence seals -----------------------------------------------------------------------
#
# An Evidence row is written with the reconciler's event, in one transaction; the event
# (format 2) carries its seal: {"id": <row id>, "payloads": {"query", "observed", "detail":
# sha256 of each}, "digest": sha256 over every other column and those payload digests}.
# Retention may later replace the payloads by its marker (`ledger.retention`): the digest
# still verifies from the payload digests the seal kept.

_PAYLOADS = ("query", "observed", "detail")
# What retention's redaction leaves in an intent or evidence payload (ledger.retention
# uses it from here: the seal must know it, and retention already imports this module).
REDACTED_PAYLOAD = {"retention": REDACTED}


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _payload_digest(value: Any) -> str:
    if isinstance(value, str):
        return _sha256(value)
    # As jsonb reads it back: the same canonical text when the row is verified.
    return _sha256(canonical_json(normalize(json.loads(json.dumps(value)))))


def _evidence_digest(row, payloads: dict[str, str]) -> str:
    return _sha256(canonical_json({
        "id": row.pk,
        "operation": row.operation_id,
        "reconciler": row.reconciler,
        "verdict": row.verdict,
        "matched_by": row.matched_by,
        "created_at": timestamp(row.created_at),
        "payloads": payloads,
    }))


def evidence_seal(row) -> dict[str, Any]:
    """The seal an operation event carries of the Evidence `row` written with it."""
    payloads = {name: _payload_digest(getattr(row, name)) for name in _PAYLOADS}
    return {"id": row.pk, "digest": _evidence_digest(row, payloads), "payloads": payloads}


def _unseal(row, seal: dict[str, Any]) -> tuple[str, str] | None:
    """None if the Evidence `row` is what `seal` sealed; else (expected, found) to report."""
    if row.redacted_at is None:
        payloads = {name: _payload_digest(getattr(row, name)) for name in _PAYLOADS}
    else:
        held = {"query": row.query, "observed": row.observed, "detail": row.detail}
        marker = {"query": REDACTED_PAYLOAD, "observed": REDACTED_PAYLOAD, "detail": ""}
        if held != marker or row.operation_redacted_at is None:
            return (f"a redacted row of a redacted operation holding {canonical_json(marker)}",
                    f"{canonical_json(held)} (operation redacted_at "
                    f"{row.operation_redacted_at})")
        payloads = seal.get("payloads") or {}
    digest = _evidence_digest(row, payloads)
    if digest != seal.get("digest"):
        return str(seal.get("digest")), digest
    return None


OPERATION_EVENTS = register(
    ChainSpec(
        name="operation_events",
        rows=_event_rows,
        payload=operation_event_payload,
        describe=lambda event: {"event_id": event.pk, "operation_id": event.operation_ref},
        format_field="chain_format",
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


def record_link_payload(row) -> dict[str, Any]:
    """The content of one RecordLink that its chain hash covers."""
    return {
        "kind": "record_link",
        "tenant": row.tenant,
        "source": row.source,
        "row": row.row_id,
        "action": row.action,
        "content": row.content,
        "before": row.before,
        "created_at": timestamp(row.created_at),
    }


def _record_rows():
    from ledger.models import RecordLink

    return RecordLink.objects.all()


RECORDS = register(
    ChainSpec(
        name="records",
        rows=_record_rows,
        payload=record_link_payload,
        describe=lambda row: {"record_link_id": row.pk, "source": row.source,
                              "row_id": row.row_id},
    )
)

# The chains the sealer links, in the order it seals them.
SEALED_CHAINS = (OPERATION_EVENTS, FACT_DECISIONS, RECORDS)


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


@dataclass(frozen=True)
class Checkpoint:
    """A head some earlier look saw: the chain must still hold this hash at this seq."""

    seq: int
    hash: str
    source: str  # who recorded it, for the message: a verification, an exported file


@dataclass
class Verification:
    record: AuditVerification
    first_break: Break | None
    # Every operation row that differs from its last event (at most MAX_DIFFERING per
    # tenant; each head's `operations_differing` counts them all).
    differing: list[Break] = field(default_factory=list)
    # Every row under the records chain that differs from its latest link, or has none,
    # or is gone while its link says it exists (at most MAX_DIFFERING per tenant; each
    # records head's `records_differing` counts them all).
    records_differing: list[Break] = field(default_factory=list)

    @property
    def is_intact(self) -> bool:
        return self.first_break is None


def verify(
    *,
    actor: str,
    progress: Callable[[str], None] | None = None,
    expected_heads: dict[tuple[str, str], Checkpoint] | None = None,
    seal_first: bool = True,
    signed_heads: dict[tuple[str, str], list[Checkpoint]] | None = None,
) -> Verification:
    """Walk every chain of every tenant; record and return the first break, if any.

    With `seal_first` (the default) the sealer links what is committed and unsealed
    first; events still unsealed after that (committed meanwhile, or every one without
    `seal_first`) are no break: each head reports them as `unsealed` (count) and
    `unsealed_since`, and their evidence rows are checked against them all the same.

    A link is broken when its stored hash differs from the hash rebuilt from its row and
    the previous link (an event or, after a purge, an anchor), when a seq has neither an
    event nor an anchor before it, or when the chain head is not the last link. A chain is
    truncated or rewritten when it no longer extends a head an earlier intact verification
    recorded, or one of `expected_heads` ((chain, tenant) -> Checkpoint, e.g. from
    `read_heads`), or one of `signed_heads` (the signed checkpoints,
    `ledger.audit_bundle.stored_checkpoints`). Then every Evidence row and every operation
    row is checked against its events (see the module's docstring). Never changes a chained row.
    """
    started = timezone.now()
    if seal_first:
        seal()
    with _one_snapshot():  # sealers and writers go on committing meanwhile
        recorded = _recorded_heads()
        expected = expected_heads or {}
        book = _SealBook()
        breaks: dict[tuple[str, str], Break] = {}  # the first per chain and tenant
        heads: dict[tuple[str, str], dict[str, Any]] = {}
        for head in ChainHead.objects.order_by("chain", "tenant"):
            spec = CHAINS.get(head.chain)
            if spec is None:
                continue
            key = (head.chain, head.tenant)
            checkpoints = [cp for cp in (recorded.get(key), expected.get(key)) if cp is not None]
            checkpoints += (signed_heads or {}).get(key, [])
            visit = book.visit if spec is OPERATION_EVENTS else None
            count, found = _verify_one(spec, head, checkpoints, visit)
            heads[key] = {"chain": head.chain, "tenant": head.tenant, "seq": head.seq,
                          "hash": head.hash, "links_checked": count}
            if found is not None:
                breaks.setdefault(key, found)
            if progress:
                progress(f"{head.chain}/{head.tenant}: {count} links, "
                         f"{'intact' if found is None else 'BROKEN'}")
        signed = {key: max(held, key=lambda cp: cp.seq)
                  for key, held in (signed_heads or {}).items() if held}
        for key in sorted({*recorded, *expected, *signed} - heads.keys()):
            if key[0] not in CHAINS:
                continue
            checkpoint = expected.get(key) or signed.get(key) or recorded[key]
            heads[key] = {"chain": key[0], "tenant": key[1], "seq": 0, "hash": "",
                          "links_checked": 0}
            breaks.setdefault(key, Break(
                key[0], key[1], checkpoint.seq, expected=f"{checkpoint.seq}:{checkpoint.hash}",
                found="no chain head", ids={},
                message=f"the chain {checkpoint.source} recorded is gone: its head row is missing",
            ))
        for tail in _visit_unsealed(book):
            key = (OPERATION_EVENTS.name, tail.tenant)
            heads.setdefault(key, {"chain": key[0], "tenant": tail.tenant, "seq": 0, "hash": "",
                                   "links_checked": 0})
            heads[key].update(unsealed=tail.events, unsealed_since=timestamp(tail.oldest_at))
        order = list(heads)
        differing: list[Break] = []
        checked = [(tenant, counts, [] if found is None else [found])
                   for tenant, counts, found in _check_evidence(book)]
        for tenant, counts, found in (*checked, *_check_operations()):
            key = (OPERATION_EVENTS.name, tenant)
            if key not in heads:  # rows of a tenant whose chain is gone entirely
                heads[key] = {"chain": key[0], "tenant": tenant, "seq": 0, "hash": "",
                              "links_checked": 0}
                order.append(key)
            for name, count in counts.items():
                heads[key][name] = heads[key].get(name, 0) + count
            if found:
                breaks.setdefault(key, found[0])
            if "operations_differing" in counts:
                differing += found
        records_differing: list[Break] = []
        for tenant, counts, found in _check_records():
            key = (RECORDS.name, tenant)
            if key not in heads:  # rows of a tenant whose records chain is gone entirely
                heads[key] = {"chain": key[0], "tenant": tenant, "seq": 0, "hash": "",
                              "links_checked": 0}
                order.append(key)
            heads[key].update(counts)
            if found:
                breaks.setdefault(key, found[0])
                records_differing += found
        for key in order:
            heads[key]["is_intact"] = key not in breaks
        first_break = next((breaks[key] for key in order if key in breaks), None)
    with transaction.atomic(durable=True):
        record = AuditVerification.objects.create(
            actor=actor[:200], started_at=started, finished_at=timezone.now(),
            links_checked=sum(head["links_checked"] for head in heads.values()),
            is_intact=first_break is None,
            first_break=first_break.as_dict() if first_break else None,
            heads=[heads[key] for key in order],
        )
    return Verification(record=record, first_break=first_break, differing=differing,
                        records_differing=records_differing)


@contextmanager
def _one_snapshot() -> Iterator[None]:
    """Every read of a verification from one snapshot (REPEATABLE READ, read only): a
    sealer or writer committing meanwhile cannot show a walk an event sealed after its
    tenant's chain was read, or a head that moved past the links read. Inside a caller's
    transaction, that transaction's reads."""
    if connection.in_atomic_block:
        yield
        return
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        yield


def _verify_one(
    spec: ChainSpec,
    head: ChainHead,
    checkpoints: list[Checkpoint] = (),
    visit: Callable[[Model], None] | None = None,
) -> tuple[int, Break | None]:
    anchors = dict(
        ChainAnchor.objects.filter(chain=spec.name, tenant=head.tenant)
        .values_list("seq", "hash")
    )
    due: dict[int, list[Checkpoint]] = {}
    for checkpoint in checkpoints:
        due.setdefault(checkpoint.seq, []).append(checkpoint)
    prev_seq, prev_hash = 0, GENESIS
    checked = 0
    latest_format = 0
    for row in _rows_in_order(spec, head.tenant):
        seq, stored = getattr(row, spec.seq_field), getattr(row, spec.hash_field)
        checked += 1
        if spec.format_field is not None:
            row_format = getattr(row, spec.format_field)
            if row_format < latest_format:
                # PostgreSQL writes every event in the current format: an older one after a
                # newer one was written or rewritten out of band, to cover less.
                return checked, Break(
                    spec.name, head.tenant, seq, expected=f"chain format {latest_format} "
                    "or later", found=f"chain format {row_format}",
                    message=f"the link's chain format went back from {latest_format} to "
                            f"{row_format}: it was written or rewritten out of band to cover "
                            "less than the links before it",
                    ids=spec.describe(row),
                )
            latest_format = row_format
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
        for checkpoint in due.pop(seq, ()):
            if checkpoint.hash != stored:
                return checked, Break(
                    spec.name, head.tenant, seq, expected=checkpoint.hash, found=stored,
                    message=f"the link at seq {seq} is not the one {checkpoint.source} "
                            "recorded: the chain was rewritten from there",
                    ids=spec.describe(row),
                )
        if visit is not None:
            visit(row)
        prev_seq, prev_hash = seq, stored
    found = _head_break(spec, head, anchors, prev_seq, prev_hash)
    return checked, found or _checkpoint_break(spec, head, anchors, due)


def _head_break(spec, head, anchors, prev_seq, prev_hash) -> Break | None:
    if head.seq != prev_seq:
        if head.seq in anchors and anchors[head.seq] == head.hash and head.seq > prev_seq:
            return None
        return Break(
            spec.name, head.tenant, head.seq, expected=f"{head.seq}:{head.hash}",
            found=f"{prev_seq}:{prev_hash}",
            message="the chain head is not the last link: links after it are missing",
            ids={},
        )
    if head.hash != prev_hash:
        return Break(
            spec.name, head.tenant, head.seq, expected=head.hash, found=prev_hash,
            message="the last link's hash differs from the chain head", ids={},
        )
    return None


def _checkpoint_break(spec, head, anchors, due) -> Break | None:
    """The recorded heads the walk did not meet: beyond the head (truncated), or purged."""
    for seq in sorted(due):
        for checkpoint in due[seq]:
            if seq > head.seq:
                return Break(
                    spec.name, head.tenant, seq, expected=f"{seq}:{checkpoint.hash}",
                    found=f"{head.seq}:{head.hash}",
                    message=f"the chain is shorter than {checkpoint.source} recorded: its "
                            f"head went back from seq {seq} to {head.seq}, the links after "
                            "it are gone",
                    ids={},
                )
            if seq in anchors and anchors[seq] != checkpoint.hash:
                return Break(
                    spec.name, head.tenant, seq, expected=checkpoint.hash, found=anchors[seq],
                    message=f"the purge anchor at seq {seq} is not the link "
                            f"{checkpoint.source} recorded",
                    ids={},
                )
            # Otherwise the link lies in a stretch the purge removed: nothing left to compare.
    return None


def _rows_in_order(spec: ChainSpec, tenant: str) -> Iterator[Model]:
    return (
        spec.rows().filter(tenant=tenant, **{f"{spec.seq_field}__isnull": False})
        .order_by(spec.seq_field).iterator(chunk_size=2000)
    )


def _visit_unsealed(book: _SealBook) -> list[Unsealed]:
    """Show `book` the events not yet sealed (their seals vouch for evidence rows too);
    per tenant, how many and since when."""
    tails: dict[str, Unsealed] = {}
    rows = _event_rows().filter(chain_seq__isnull=True).order_by("tenant", "id")
    for event in rows.iterator(chunk_size=2000):
        book.visit(event)
        tail = tails.get(event.tenant)
        tails[event.tenant] = Unsealed(
            event.tenant, (tail.events if tail else 0) + 1,
            min(tail.oldest_at, event.created_at) if tail else event.created_at)
    return list(tails.values())


# --- the heads earlier looks saw -----------------------------------------------------------

_RECORDED_HEADS = """
    SELECT DISTINCT ON (h.value->>'chain', h.value->>'tenant')
           h.value->>'chain', h.value->>'tenant', (h.value->>'seq')::bigint, h.value->>'hash',
           v.id, v.finished_at, v.actor
      FROM ledger_auditverification v CROSS JOIN LATERAL jsonb_array_elements(v.heads) h
     WHERE jsonb_typeof(v.heads) = 'array' AND h.value->>'is_intact' = 'true'
       AND (h.value->>'seq')::bigint > 0
     ORDER BY h.value->>'chain', h.value->>'tenant', (h.value->>'seq')::bigint DESC, v.id DESC
"""


def _recorded_heads() -> dict[tuple[str, str], Checkpoint]:
    """Per chain and tenant, the longest head an earlier verification found intact."""
    with connection.cursor() as cursor:
        cursor.execute(_RECORDED_HEADS)
        return {
            (chain, tenant): Checkpoint(
                seq=seq, hash=digest,
                source=f"verification {pk} ({finished:%Y-%m-%d %H:%M:%S} UTC, {actor})",
            )
            for chain, tenant, seq, digest, pk, finished, actor in cursor.fetchall()
        }


def export_heads(record: AuditVerification) -> dict[str, Any]:
    """The heads `record` verified, as `manage.py verify_audit --export-head` writes them:
    {"heads": {chain: {tenant: {"seq": n, "hash": h}}}}, with when and which verification."""
    heads: dict[str, dict[str, dict[str, Any]]] = {}
    for head in record.heads:
        if head.get("seq"):
            heads.setdefault(head["chain"], {})[head["tenant"]] = {
                "seq": head["seq"], "hash": head["hash"]}
    return {"verification": record.pk, "verified_at": timestamp(record.finished_at),
            "heads": heads}


def read_heads(text: str, *, source: str) -> dict[tuple[str, str], Checkpoint]:
    """The heads of an `export_heads` document (`text`), as checkpoints named `source`.

    Raises ValueError saying what was expected and what was found.
    """
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"expected {source} to hold JSON, found {exc}") from None
    heads = document.get("heads") if isinstance(document, dict) else None
    if not isinstance(heads, dict):
        raise ValueError(f"expected {source} to be an object with \"heads\": "
                         f"{{chain: {{tenant: {{\"seq\", \"hash\"}}}}}}, found "
                         f"{canonical_json(document)[:200]}")
    found: dict[tuple[str, str], Checkpoint] = {}
    for chain_name, tenants in heads.items():
        if not isinstance(tenants, dict):
            raise ValueError(f"expected heads.{chain_name} in {source} to map tenants to "
                             f"heads, found {canonical_json(tenants)[:200]}")
        for tenant, head in tenants.items():
            seq = head.get("seq") if isinstance(head, dict) else None
            digest = head.get("hash") if isinstance(head, dict) else None
            if (not isinstance(seq, int) or isinstance(seq, bool) or seq < 1
                    or not isinstance(digest, str) or len(digest) != 64):
                raise ValueError(
                    f"expected heads.{chain_name}.{tenant} in {source} to be {{\"seq\": a "
                    f"positive integer, \"hash\": 64 hex digits}}, found "
                    f"{canonical_json(head)[:200]}")
            found[(chain_name, tenant)] = Checkpoint(seq=seq, hash=digest, source=source)
    return found


# --- evidence and operation rows against their events --------------------------------------


@dataclass(frozen=True)
class _Sealed:
    event_id: int
    operation_id: int
    operation_ref: str
    tenant: str
    seq: int
    seal: dict[str, Any]


class _SealBook:
    """What the walk of operation events saw that vouches for Evidence rows."""

    def __init__(self):
        self.seals: dict[int, _Sealed] = {}
        # Format 1 reconciler events: (verdict, matched_by) of the row written with each.
        self.unsealed: dict[int, list[tuple[str, str]]] = {}

    def visit(self, event) -> None:
        if event.chain_format >= 2:
            if isinstance(event.evidence_seal, dict) and "id" in event.evidence_seal:
                self.seals[event.evidence_seal["id"]] = _Sealed(
                    event.pk, event.operation_id, event.operation_ref, event.tenant,
                    event.chain_seq or 0, event.evidence_seal)
        elif (event.actor_kind == ActorKind.RECONCILER and isinstance(event.evidence, dict)
              and "verdict" in event.evidence):
            self.unsealed.setdefault(event.operation_id, []).append(
                (event.evidence.get("verdict"), event.evidence.get("matched_by") or ""))


def _check_evidence(book: _SealBook) -> Iterator[tuple[str, dict[str, int], Break | None]]:
    """Per tenant: (tenant, counts, first break) of its Evidence rows against the events."""
    from django.db.models import F

    from ledger.models import Evidence

    counts: dict[str, dict[str, int]] = {}
    breaks: dict[str, Break] = {}
    rows = Evidence.objects.annotate(
        tenant=F("operation__tenant"), operation_ref=F("operation__operation_id"),
        operation_redacted_at=F("operation__redacted_at"),
    ).order_by("id")
    for row in rows.iterator(chunk_size=2000):
        tally = counts.setdefault(row.tenant, {"evidence_checked": 0, "evidence_before_seals": 0})
        tally["evidence_checked"] += 1
        sealed = book.seals.pop(row.pk, None)
        ids = {"evidence_id": row.pk, "operation_id": row.operation_ref}
        if sealed is not None:
            ids["event_id"] = sealed.event_id
            if sealed.operation_id != row.operation_id:
                breaks.setdefault(row.tenant, Break(
                    OPERATION_EVENTS.name, row.tenant, sealed.seq,
                    expected=f"operation {sealed.operation_ref}",
                    found=f"operation {row.operation_ref}", ids=ids,
                    message="the evidence row was moved to another operation than the one "
                            "whose event sealed it"))
                continue
            mismatch = _unseal(row, sealed.seal)
            if mismatch is not None:
                breaks.setdefault(row.tenant, Break(
                    OPERATION_EVENTS.name, row.tenant, sealed.seq, expected=mismatch[0],
                    found=mismatch[1], ids=ids,
                    message="the evidence row differs from the seal its event carries: it "
                            "was rewritten out of band"))
            continue
        # Written before seals: the reconciler's event of that time names its verdict.
        pending = book.unsealed.get(row.operation_id, [])
        if (row.verdict, row.matched_by) in pending:
            pending.remove((row.verdict, row.matched_by))
            tally["evidence_before_seals"] += 1
            continue
        breaks.setdefault(row.tenant, Break(
            OPERATION_EVENTS.name, row.tenant, 0,
            expected=f"an event of operation {row.operation_ref} sealing evidence row "
                     f"{row.pk} (or, before seals, a reconciler event with verdict "
                     f"{row.verdict!r})",
            found="none", ids=ids,
            message="no event accounts for the evidence row: it was inserted out of band"))
    for sealed in sorted(book.seals.values(), key=lambda s: (s.tenant, s.seq)):
        counts.setdefault(sealed.tenant, {"evidence_checked": 0, "evidence_before_seals": 0})
        breaks.setdefault(sealed.tenant, Break(
            OPERATION_EVENTS.name, sealed.tenant, sealed.seq,
            expected=f"evidence row {sealed.seal['id']}", found="none",
            ids={"evidence_id": sealed.seal["id"], "operation_id": sealed.operation_ref,
                 "event_id": sealed.event_id},
            message="the evidence row this event sealed is gone: it was deleted out of band"))
    for tenant in sorted(counts.keys() | breaks.keys()):
        yield tenant, counts.get(tenant, {}), breaks.get(tenant)


# An operation's content as verification holds it to its last event: the stored row's, but
# what changes without an event of its own is held to what may change it. An intent and
# error detail retention redacted (the intent's marker, redacted_at, and the Redaction row
# that recorded it): their digests are then the event's own (the values are gone). The
# duplicate mark of a succeeded operation with a succeeded twin (another operation's
# success sets it): then the event's own conflict.
_REDACTED = (f"o.redacted_at IS NOT NULL AND o.intent = '{canonical_json(REDACTED_PAYLOAD)}'"
             "::jsonb AND EXISTS (SELECT 1 FROM ledger_redaction r WHERE r.operation_ref = "
             "o.operation_id)")
_HELD = {
    "intent": f"CASE WHEN {_REDACTED} THEN e.content->>'intent' ELSE "
              + _digest_sql("o.intent") + " END",
    "error_detail": f"CASE WHEN {_REDACTED} AND o.error_detail = '' THEN "
                    "e.content->>'error_detail' ELSE " + _digest_sql("o.error_detail") + " END",
    "conflict": "CASE WHEN o.conflict = 'duplicate' AND o.state = 'succeeded' AND EXISTS ("
                "SELECT 1 FROM ledger_operation twin WHERE twin.tenant = o.tenant AND "
                "twin.operation = o.operation AND twin.intent_fingerprint = "
                "o.intent_fingerprint AND twin.state = 'succeeded' AND twin.id <> o.id) "
                "THEN e.content->>'conflict' ELSE o.conflict END",
}
_HELD_CONTENT = (f"CASE WHEN e.chain_format >= 5 THEN "
                 f"{content_sql('o', chain_format=5, held=_HELD)} "
                 f"WHEN e.chain_format >= 4 THEN "
                 f"{content_sql('o', chain_format=4, held=_HELD)} "
                 f"ELSE {content_sql('o', chain_format=3, held=_HELD)} END")

# Each operation against its last event: one pass, every mismatch per tenant.
_LAST_EVENTS = f"""
    WITH last AS (
        SELECT o.id, o.tenant, e.chain_format,
               e.id IS NULL OR o.state <> e.to_state OR o.version <> e.version
               OR (e.chain_format >= 2 AND o.external_id <> e.external_id)
               OR (e.chain_format >= 3 AND {_HELD_CONTENT} IS DISTINCT FROM e.content)
               AS differs
          FROM ledger_operation o
          LEFT JOIN LATERAL (
              SELECT id, to_state, version, chain_format, external_id, content
                FROM ledger_operationevent WHERE operation_id = o.id
               ORDER BY version DESC LIMIT 1) e ON true
    )
    SELECT tenant, count(*), count(*) FILTER (WHERE chain_format < 2),
           count(*) FILTER (WHERE chain_format < 3),
           count(*) FILTER (WHERE chain_format < 4),
           array_agg(id ORDER BY id) FILTER (WHERE differs)
      FROM last GROUP BY tenant ORDER BY tenant
"""

_DIFFERING = f"""
    SELECT o.operation_id, o.state, o.version, o.external_id, {_HELD_CONTENT},
           e.id, e.chain_seq, e.to_state, e.version, e.chain_format, e.external_id, e.content
      FROM ledger_operation o
      LEFT JOIN LATERAL (
          SELECT * FROM ledger_operationevent WHERE operation_id = o.id
           ORDER BY version DESC LIMIT 1) e ON true
     WHERE o.id = ANY(%s)
     ORDER BY o.id
"""

# Rows that differ, reported one by one (per tenant; the count says how many in all).
MAX_DIFFERING = 1000


def _check_operations() -> Iterator[tuple[str, dict[str, int], list[Break]]]:
    """Per tenant: (tenant, counts, a break per operation row that differs from its last
    event): state and version always, external_id from format 2, content from format 3."""
    with connection.cursor() as cursor:
        cursor.execute(_LAST_EVENTS)
        tenants = cursor.fetchall()
        for (tenant, operations, before_format_2, before_format_3, before_format_4,
             differing) in tenants:
            counts = {"operations_checked": operations,
                      "operations_external_id_unchecked": before_format_2,
                      "operations_content_unchecked": before_format_3,
                      "operations_columns_unchecked": before_format_4,
                      "operations_differing": len(differing or ())}
            if not differing:
                yield tenant, counts, []
                continue
            cursor.execute(_DIFFERING, [differing[:MAX_DIFFERING]])
            yield tenant, counts, [_differs(tenant, *row) for row in cursor.fetchall()]


def _differs(tenant, operation_ref, state, version, external_id, content, event_id, seq,
             to_state, event_version, chain_format, event_external_id, event_content
             ) -> Break:
    ids = {"operation_id": operation_ref}
    if event_id is None:
        return Break(OPERATION_EVENTS.name, tenant, 0, expected="an event recording it",
                     found=f"none (state {state}, version {version})", ids=ids,
                     message="the operation has no event: it was inserted out of band")
    ids["event_id"] = event_id
    with_id = chain_format >= 2
    expected = _row_state(to_state, event_version, event_external_id, with_id)
    found = _row_state(state, version, external_id, with_id)
    fields = [name for name, a, b in (("state", state, to_state),
                                      ("version", version, event_version),
                                      ("external_id", external_id, event_external_id))
              if a != b and (with_id or name != "external_id")]
    if chain_format >= 3:
        # Django reads jsonb as text through a plain cursor.
        held, recorded = (json.loads(value) if isinstance(value, str) else value or {}
                          for value in (content, event_content))
        changed = sorted(key for key in held.keys() | recorded.keys()
                         if held.get(key) != recorded.get(key))
        fields += changed
        if changed:
            expected += "; " + _content_text(recorded, changed)
            found += "; " + _content_text(held, changed)
    return Break(OPERATION_EVENTS.name, tenant, seq or 0, expected=expected, found=found,
                 ids=ids, message=f"the operation row differs from its last event in "
                                  f"{', '.join(fields)}: it was changed out of band")


def _content_text(content: dict[str, Any], keys: list[str]) -> str:
    digests = DIGESTS
    return ", ".join(
        f"{key} " + (f"sha256 {content.get(key)}" if key in digests and content.get(key)
                     else repr(content.get(key)))
        for key in keys)


def _row_state(state: str, version: int, external_id: str, with_id: bool) -> str:
    text = f"state {state}, version {version}"
    return text + (f", external_id {external_id!r}" if with_id else "")


# --- rows people rely on against their latest record link -----------------------------------

# Every stored row of the record sources beside the latest link of each (source, row):
# those that differ (content), that no link accounts for (inserted out of band), that are
# gone while their link says they exist (deleted out of band), or that a delete link says
# are gone but are there (re-inserted out of band).
_STORED_RECORDS = " UNION ALL ".join(
    f"SELECT '{source}'::varchar AS source, t.id::bigint AS row_id, t.tenant::varchar AS tenant, "
    f"{record_content_sql('t')} AS content FROM {table} t"
    for source, table in RECORD_SOURCES.items())
_CHECK_RECORDS = f"""
    WITH latest AS (
        SELECT DISTINCT ON (source, row_id) id, tenant, source, row_id, action, content,
               chain_seq
          FROM ledger_recordlink ORDER BY source, row_id, id DESC),
    stored AS ({_STORED_RECORDS}),
    joined AS (
        SELECT coalesce(l.tenant, s.tenant) AS tenant, coalesce(l.source, s.source) AS source,
               coalesce(l.row_id, s.row_id) AS row_id, l.id AS link_id,
               l.chain_seq, l.action, l.content AS linked, s.row_id IS NOT NULL AS is_stored,
               s.content AS held,
               s.row_id IS NOT NULL AND (l.id IS NULL OR l.action = 'delete'
                                         OR l.content IS DISTINCT FROM s.content)
               OR s.row_id IS NULL AND l.action <> 'delete' AS differs
          FROM stored s FULL JOIN latest l ON l.source = s.source AND l.row_id = s.row_id)
    SELECT tenant, count(*) FILTER (WHERE is_stored), count(*) FILTER (WHERE differs),
           (array_agg(jsonb_build_array(source, row_id, link_id, chain_seq, action, linked,
                                        is_stored, held)
                      ORDER BY source, row_id) FILTER (WHERE differs))[1:{{limit}}]
      FROM joined GROUP BY tenant ORDER BY tenant
"""


# Each update or delete link against the link before it of the same row: what the row held
# before the change must be what that link recorded. Otherwise the row was changed out of
# band in between, and the later change would absorb it.
_CUSTODY = """
    SELECT tenant, source, row_id, id, chain_seq, action, before, prev_id, prev_content
      FROM (SELECT l.*, lag(l.id) OVER w AS prev_id, lag(l.content) OVER w AS prev_content
              FROM ledger_recordlink l WINDOW w AS (PARTITION BY source, row_id ORDER BY id)) x
     WHERE action <> 'insert' AND (prev_id IS NULL OR before IS DISTINCT FROM prev_content)
     ORDER BY tenant, chain_seq NULLS LAST, id
"""


def _check_records() -> Iterator[tuple[str, dict[str, int], list[Break]]]:
    """Per tenant: (tenant, counts, a break per record row that differs from its latest
    link, `_CHECK_RECORDS`, then per link whose `before` is not what the link before it
    recorded, `_CUSTODY`)."""
    custody: dict[str, list[Break]] = {}
    with connection.cursor() as cursor:
        cursor.execute(_CUSTODY)
        for (tenant, source, row_id, link_id, seq, action, before, prev_id,
             prev) in cursor.fetchall():
            before, prev = (json.loads(v) if isinstance(v, str) else v or {}
                            for v in (before, prev))
            changed = sorted(key for key in before.keys() | prev.keys()
                             if before.get(key) != prev.get(key))
            name = source.replace("_", " ")
            ids = {"source": source, "row_id": row_id, "record_link_id": link_id}
            custody.setdefault(tenant, []).append(Break(
                RECORDS.name, tenant, seq or 0,
                expected=(f"link {prev_id}'s content: " + ", ".join(
                    f"{key} sha256 {prev.get(key)}" for key in changed))
                if prev_id is not None else "a record link of its insert",
                found=("before the " + action + ": " + ", ".join(
                    f"{key} sha256 {before.get(key)}" for key in changed))
                if prev_id is not None else "none",
                ids=ids,
                message=(f"the {name} row was changed out of band before this {action} "
                         f"(in {', '.join(changed)})") if prev_id is not None else
                        f"the {name} row had no record link before this {action}: it was "
                        "inserted out of band"))
        cursor.execute(_CHECK_RECORDS.format(limit=MAX_DIFFERING))
        tenants = cursor.fetchall()
    seen = set()
    for tenant, stored, differing, rows in tenants:
        seen.add(tenant)
        found = custody.get(tenant, [])
        counts = {"records_checked": stored, "records_differing": differing + len(found)}
        rows = [json.loads(row) if isinstance(row, str) else row for row in rows or ()]
        yield tenant, counts, [_record_differs(tenant, *row) for row in rows] + found
    for tenant in sorted(custody.keys() - seen):
        yield tenant, {"records_checked": 0, "records_differing": len(custody[tenant])}, \
            custody[tenant]


def _record_differs(tenant, source, row_id, link_id, seq, action, linked, is_stored, held
                    ) -> Break:
    ids = {"source": source, "row_id": row_id}
    if link_id is not None:
        ids["record_link_id"] = link_id
    name = source.replace("_", " ")
    if link_id is None:
        return Break(RECORDS.name, tenant, 0, expected="a record link of it", found="none",
                     ids=ids, message=f"the {name} row has no record link: it was inserted "
                                      "out of band")
    if not is_stored:
        done = {"insert": "inserted", "update": "updated"}.get(action, action)
        return Break(RECORDS.name, tenant, seq or 0, expected=f"the {name} row ({done})",
                     found="none", ids=ids,
                     message=f"the {name} row is gone but its last record link says it was "
                             f"{done}: it was deleted out of band")
    if action == "delete":
        return Break(RECORDS.name, tenant, seq or 0, expected="no row (its last link deleted it)",
                     found="the row", ids=ids,
                     message=f"the {name} row is there but its last record link deleted it: "
                             "it was inserted again out of band")
    linked, held = linked or {}, held or {}
    changed = sorted(key for key in linked.keys() | held.keys()
                     if linked.get(key) != held.get(key))
    return Break(RECORDS.name, tenant, seq or 0,
                 expected=", ".join(f"{key} sha256 {linked.get(key)}" for key in changed),
                 found=", ".join(f"{key} sha256 {held.get(key)}" for key in changed), ids=ids,
                 message=f"the {name} row differs from its last record link in "
                         f"{', '.join(changed)}: it was rewritten out of band")
