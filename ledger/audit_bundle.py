"""Signed checkpoints and the audit bundle: the chains verified outside the database.

`export` (`manage.py audit_export`) writes a self-contained bundle: every link of every
chain (its seq, hash and the body its hash covers: the event or decision itself), each
chain's purge anchors and head, and every signed checkpoint; the whole document signed with
Ed25519 (`LEDGER_AUDIT_SIGNING_KEY`, the `cryptography` package). Before it signs, it holds
the chains to the checkpoints signed before (as `verify_bundle` does) and refuses a trail
that does not verify; then it signs each chain's head as a new checkpoint
(`AuditCheckpoint`, kept in the database, append-only) and puts it in the bundle.

`verify_bundle` (`manage.py verify_audit --bundle FILE --public-key KEY`) needs no database:
the bundle's signature, every checkpoint's signature, every link's hash from its body and the
link before it (or the purge anchor the chain resumes from), each head, and each chain
against every checkpoint. A signed checkpoint the database's owner cannot forge: a chain
re-linked from the start, or cut back behind a checkpoint (its tail deleted, the head
rewound), no longer holds that checkpoint's hash at its seq, or ends before it. The
checkpoints make that visible as long as one covering the change remains: their owner can
delete rows, and a chain cut back together with every checkpoint past the cut is visible
only against an earlier bundle or exported head (keep them where the owner cannot reach).

A purge deletes links but leaves a `ChainAnchor` where the chain resumes: a checkpoint in a
purged stretch has nothing left to compare and is counted as such; the chain still
verifies from its anchors.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ledger.canonical import canonical_json

BUNDLE_FORMAT = "agent-ledger-audit-bundle/1"
CHECKPOINT_KIND = "agent-ledger-checkpoint/1"
GENESIS = "0" * 64


# --- keys -------------------------------------------------------------------------------------


def load_private_key(text: str) -> Ed25519PrivateKey:
    """An Ed25519 private key from PEM (PKCS#8, unencrypted) or its 32-byte seed in hex."""
    text = text.strip()
    try:
        if text.startswith("-----BEGIN"):
            key = serialization.load_pem_private_key(text.encode("ascii"), password=None)
        else:
            key = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(text))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"expected an Ed25519 private key (PEM, or 64 hex digits), found a "
                         f"text of {len(text)} characters that is not one ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"expected an Ed25519 private key, found {type(key).__name__}")
    return key


def load_public_key(text: str) -> Ed25519PublicKey:
    """An Ed25519 public key from PEM (SubjectPublicKeyInfo) or its 32 bytes in hex."""
    text = text.strip()
    try:
        if text.startswith("-----BEGIN"):
            key = serialization.load_pem_public_key(text.encode("ascii"))
        else:
            key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(text))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"expected an Ed25519 public key (PEM, or 64 hex digits), found a "
                         f"text of {len(text)} characters that is not one ({exc})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"expected an Ed25519 public key, found {type(key).__name__}")
    return key


def public_key_hex(key: Ed25519PublicKey) -> str:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()


def key_id(key: Ed25519PublicKey) -> str:
    """The name of a public key in checkpoints and bundles: 16 hex digits of its sha256."""
    return hashlib.sha256(bytes.fromhex(public_key_hex(key))).hexdigest()[:16]


def checkpoint_message(checkpoint: dict[str, Any]) -> bytes:
    """What a checkpoint's signature covers: its chain, tenant, seq, hash, time and key."""
    return canonical_json({
        "kind": CHECKPOINT_KIND, "chain": checkpoint["chain"], "tenant": checkpoint["tenant"],
        "seq": checkpoint["seq"], "hash": checkpoint["hash"],
        "signed_at": checkpoint["signed_at"], "key_id": checkpoint["key_id"],
    }).encode("utf-8")


def _bundle_message(document: dict[str, Any]) -> bytes:
    return canonical_json({k: v for k, v in document.items() if k != "signature"}).encode()


# --- verification, without the database ---------------------------------------------------------


@dataclass
class BundleBreak:
    chain: str
    tenant: str
    seq: int
    expected: str
    found: str
    message: str

    def __str__(self) -> str:
        return (f"{self.chain}/{self.tenant} at seq {self.seq}: {self.message}; expected "
                f"{self.expected}, found {self.found}")


@dataclass
class BundleReport:
    exported_at: str = ""
    links: int = 0
    chains: int = 0
    checkpoints: int = 0  # held against the chains
    checkpoints_purged: int = 0  # in a stretch a purge removed: nothing left to compare
    checkpoints_other_keys: int = 0  # signed by a key not given: not checked
    breaks: list[BundleBreak] = field(default_factory=list)

    @property
    def is_intact(self) -> bool:
        return not self.breaks


def read_bundle(text: str, *, source: str) -> dict[str, Any]:
    """The bundle `text` as a document; ValueError saying what was expected and found."""
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"expected {source} to hold JSON, found {exc}") from None
    if not isinstance(document, dict) or document.get("format") != BUNDLE_FORMAT:
        found = document.get("format") if isinstance(document, dict) else type(document)
        raise ValueError(f"expected {source} to be an audit bundle ({BUNDLE_FORMAT}), found "
                         f"format {found!r}")
    for name, kind in (("chains", list), ("checkpoints", list), ("key_id", str),
                       ("signature", str)):
        if not isinstance(document.get(name), kind):
            raise ValueError(f"expected {source} to have {name!r} ({kind.__name__}), found "
                             f"{type(document.get(name)).__name__}")
    return document


def verify_bundle(document: dict[str, Any], public_keys: list[Ed25519PublicKey], *,
                  signed: bool = True) -> BundleReport:
    """Every check of a bundle (see the module's docstring), with no database; `signed`:
    also the bundle's own signature (the exporter checks a bundle before signing it)."""
    keys = {key_id(key): key for key in public_keys}
    report = BundleReport(exported_at=str(document.get("exported_at", "")))
    if signed:
        key = keys.get(document["key_id"])
        if key is None:
            report.breaks.append(BundleBreak(
                "bundle", "", 0, expected=f"a bundle signed by one of the keys given "
                f"({', '.join(sorted(keys)) or 'none'})", found=f"key {document['key_id']}",
                message="the bundle is signed by another key"))
            return report
        try:
            key.verify(bytes.fromhex(document["signature"]), _bundle_message(document))
        except (InvalidSignature, ValueError):
            report.breaks.append(BundleBreak(
                "bundle", "", 0, expected=f"a valid signature of key {document['key_id']}",
                found="a signature that does not verify",
                message="the bundle was changed after it was signed"))
            return report
    chains = {}
    for entry in document["chains"]:
        key = (entry["chain"], entry["tenant"])
        chains[key] = entry
        report.chains += 1
        found = _walk(entry, report)
        if found is not None:
            report.breaks.append(found)
    for checkpoint in document["checkpoints"]:
        found = _hold(checkpoint, chains, keys, report)
        if found is not None:
            report.breaks.append(found)
    return report


def _walk(entry: dict[str, Any], report: BundleReport) -> BundleBreak | None:
    from ledger.chain import link_hash

    name, tenant = entry["chain"], entry["tenant"]
    anchors = {int(seq): digest for seq, digest in entry.get("anchors", {}).items()}
    prev_seq, prev_hash, latest_format = 0, GENESIS, 0
    for link in entry["links"]:
        seq, stored, body = link["seq"], link["hash"], link["body"]
        report.links += 1
        if seq != prev_seq + 1:
            if seq <= prev_seq or seq - 1 not in anchors:
                return BundleBreak(name, tenant, seq, expected=f"a link or purge anchor at "
                                   f"{seq - 1}", found=f"the previous link at {prev_seq}",
                                   message=f"link {seq - 1} is missing and no purge anchor "
                                           "replaces it")
            prev_hash = anchors[seq - 1]
        if name == "operation_events":
            row_format = body.get("chain_format", 1)
            if row_format < latest_format:
                return BundleBreak(name, tenant, seq, expected=f"chain format "
                                   f"{latest_format} or later", found=f"chain format "
                                   f"{row_format}", message="the link's chain format went "
                                   "back: it was written or rewritten to cover less")
            latest_format = row_format
        expected = link_hash(body, prev=prev_hash, seq=seq)
        if expected != stored:
            return BundleBreak(name, tenant, seq, expected=expected, found=stored,
                               message="the stored hash does not match the link's body and "
                                       "the previous link")
        prev_seq, prev_hash = seq, stored
    head = entry["head"]
    if head["seq"] != prev_seq and not (head["seq"] > prev_seq
                                        and anchors.get(head["seq"]) == head["hash"]):
        return BundleBreak(name, tenant, head["seq"], expected=f"{head['seq']}:{head['hash']}",
                           found=f"{prev_seq}:{prev_hash}",
                           message="the chain head is not the last link")
    if head["seq"] == prev_seq and head["hash"] != prev_hash:
        return BundleBreak(name, tenant, head["seq"], expected=head["hash"], found=prev_hash,
                           message="the last link's hash differs from the chain head")
    return None


def _hold(checkpoint: dict[str, Any], chains: dict, keys: dict,
          report: BundleReport) -> BundleBreak | None:
    """`checkpoint` against its chain: signed by a given key, and the chain holds it."""
    name, tenant, seq = checkpoint["chain"], checkpoint["tenant"], checkpoint["seq"]
    key = keys.get(checkpoint["key_id"])
    if key is None:
        report.checkpoints_other_keys += 1
        return None
    try:
        key.verify(bytes.fromhex(checkpoint["signature"]), checkpoint_message(checkpoint))
    except (InvalidSignature, ValueError):
        return BundleBreak(name, tenant, seq, expected=f"a valid signature of key "
                           f"{checkpoint['key_id']}", found="a signature that does not verify",
                           message=f"the checkpoint signed at {checkpoint['signed_at']} is "
                                   "forged or altered")
    report.checkpoints += 1
    source = f"the checkpoint signed at {checkpoint['signed_at']}"
    entry = chains.get((name, tenant))
    if entry is None:
        return BundleBreak(name, tenant, seq, expected=f"{seq}:{checkpoint['hash']}",
                           found="no chain", message=f"the chain {source} covers is gone")
    head = entry["head"]
    if seq > head["seq"]:
        return BundleBreak(name, tenant, seq, expected=f"{seq}:{checkpoint['hash']}",
                           found=f"{head['seq']}:{head['hash']}",
                           message=f"the chain is shorter than {source} says: its links "
                                   f"after seq {head['seq']} are gone")
    link = next((link for link in entry["links"] if link["seq"] == seq), None)
    anchor = entry.get("anchors", {}).get(str(seq))
    held = link["hash"] if link is not None else anchor
    if held is None:
        report.checkpoints_purged += 1
        return None
    if held != checkpoint["hash"]:
        return BundleBreak(name, tenant, seq, expected=checkpoint["hash"], found=held,
                           message=f"the link at seq {seq} is not the one {source} covers: "
                                   "the chain was rewritten from there")
    return None


# --- export, from the database -------------------------------------------------------------------


def export(private_key: Ed25519PrivateKey, *, seal_first: bool = True,
           now: datetime | None = None) -> dict[str, Any]:
    """The signed bundle of every chain, after signing each head as a new checkpoint.

    Raises ValueError naming the first break when the trail does not verify against the
    checkpoints signed before (nothing is signed then).
    """
    from django.db import transaction
    from django.utils import timezone

    from ledger import chain
    from ledger.models import AuditCheckpoint, ChainAnchor, ChainHead

    public = private_key.public_key()
    kid = key_id(public)
    if seal_first:
        chain.seal()
    chains = []
    with chain._one_snapshot():
        for head in ChainHead.objects.order_by("chain", "tenant"):
            spec = chain.CHAINS.get(head.chain)
            if spec is None:
                continue
            links = [{"seq": getattr(row, spec.seq_field), "hash": getattr(row, spec.hash_field),
                      "body": chain.normalize(spec.payload(row))}
                     for row in chain._rows_in_order(spec, head.tenant)]
            anchors = {str(seq): digest for seq, digest in ChainAnchor.objects.filter(
                chain=head.chain, tenant=head.tenant).values_list("seq", "hash")}
            chains.append({"chain": head.chain, "tenant": head.tenant,
                           "head": {"seq": head.seq, "hash": head.hash},
                           "links": links, "anchors": anchors})
        checkpoints = [_as_dict(row) for row in AuditCheckpoint.objects.order_by("id")]
    document = json.loads(json.dumps({  # as it reads back from the file
        "format": BUNDLE_FORMAT, "exported_at": chain.timestamp(now or timezone.now()),
        "key_id": kid, "public_key": public_key_hex(public), "chains": chains,
        "checkpoints": checkpoints, "signature": "",
    }))
    report = verify_bundle(document, [public], signed=False)
    if not report.is_intact:
        raise ValueError(f"expected the audit trail to verify before signing its heads, "
                         f"found a break in {report.breaks[0]}")
    signed_at = document["exported_at"]
    new = []
    for entry in chains:
        checkpoint = {"chain": entry["chain"], "tenant": entry["tenant"],
                      "seq": entry["head"]["seq"], "hash": entry["head"]["hash"],
                      "signed_at": signed_at, "key_id": kid}
        checkpoint["signature"] = private_key.sign(checkpoint_message(checkpoint)).hex()
        new.append(checkpoint)
    with transaction.atomic(durable=True):
        AuditCheckpoint.objects.bulk_create([
            AuditCheckpoint(chain=c["chain"], tenant=c["tenant"], seq=c["seq"], hash=c["hash"],
                            signed_at=datetime.fromisoformat(c["signed_at"]),
                            key_id=c["key_id"], signature=c["signature"]) for c in new])
    document["checkpoints"] += new
    document["signature"] = private_key.sign(_bundle_message(document)).hex()
    return document


def _as_dict(row) -> dict[str, Any]:
    from ledger.chain import timestamp

    return {"chain": row.chain, "tenant": row.tenant, "seq": row.seq, "hash": row.hash,
            "signed_at": timestamp(row.signed_at), "key_id": row.key_id,
            "signature": row.signature}


def stored_checkpoints(public_keys: list[Ed25519PublicKey]) -> tuple[dict, list[str]]:
    """The signed checkpoints in the database whose signature one of `public_keys`
    verifies, as `ledger.chain.Checkpoint`s by (chain, tenant), for `chain.verify`; and a
    description of each that does not verify (forged or altered)."""
    from ledger.chain import Checkpoint
    from ledger.models import AuditCheckpoint

    keys = {key_id(key): key for key in public_keys}
    held: dict[tuple[str, str], list[Checkpoint]] = {}
    forged: list[str] = []
    if not keys:
        return held, forged
    for row in AuditCheckpoint.objects.order_by("id"):
        key = keys.get(row.key_id)
        if key is None:
            continue
        checkpoint = _as_dict(row)
        try:
            key.verify(bytes.fromhex(row.signature), checkpoint_message(checkpoint))
        except (InvalidSignature, ValueError):
            forged.append(f"checkpoint {row.pk} ({row.chain}/{row.tenant} at seq {row.seq}, "
                          f"signed at {checkpoint['signed_at']})")
            continue
        held.setdefault((row.chain, row.tenant), []).append(Checkpoint(
            seq=row.seq, hash=row.hash,
            source=f"signed checkpoint {row.pk} ({checkpoint['signed_at']})"))
    return held, forged
