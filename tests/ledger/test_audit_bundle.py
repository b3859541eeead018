"""A verifier outside the database (issue 41, item 8): `manage.py audit_export` writes a
signed, self-contained bundle that `verify_audit --bundle FILE --public-key KEY` verifies
with no database at all; the signed checkpoints make a full re-chain and a truncated tail
visible without --expect-head; a purge leaves the chain verifiable against them."""

import json
import os
import subprocess
import sys

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.core.management import call_command
from django.core.management.base import CommandError

from ledger import audit_bundle, chain, retention
from ledger.models import AuditCheckpoint, AuditVerification, ChainHead, OperationEvent
from ledger.states import State
from tests.factories import OperationFactory
from tests.ledger.test_verify_audit_tamper import remove_newest, tamper, verify_audit
from tests.support.processes import ROOT
from tests.support.retention import complete_days_ago, raw_connection, retention_admin

KEY = Ed25519PrivateKey.generate()
PUBLIC = audit_bundle.public_key_hex(KEY.public_key())
SEED = KEY.private_bytes_raw().hex()


@pytest.fixture
def signing_key(settings):
    settings.LEDGER_AUDIT_SIGNING_KEY = SEED
    return KEY


def export(tmp_path, name="bundle.json") -> tuple[str, dict]:
    path = tmp_path / name
    call_command("audit_export", "--output", str(path))
    return str(path), json.loads(path.read_text())


def verify_offline(bundle: str, *keys: str) -> tuple[int, str, str]:
    """verify_audit --bundle in a child whose database is nowhere (port 1, no such name)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEDGER_DATABASE")}
    env["DATABASE_URL"] = "postgres://nobody@127.0.0.1:1/nowhere"
    args = [arg for key in keys for arg in ("--public-key", key)]
    child = subprocess.run([sys.executable, "manage.py", "verify_audit", "--bundle", bundle,
                            *args], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=120)
    return child.returncode, child.stdout, child.stderr


def trail(*tenants: str) -> list:
    return [OperationFactory(state=State.SUCCEEDED, tenant=tenant) for tenant in tenants]


@pytest.mark.django_db(transaction=True)
def test_a_bundle_verifies_without_the_database_and_names_a_change(signing_key, tmp_path):
    trail("acme", "acme", "globex")
    path, document = export(tmp_path)
    assert {(c["chain"], c["tenant"]) for c in document["checkpoints"]} == {
        ("operation_events", "acme"), ("operation_events", "globex")}
    assert AuditCheckpoint.objects.count() == 2
    key_file = tmp_path / "public.hex"
    key_file.write_text(PUBLIC + "\n")

    status, out, err = verify_offline(path, str(key_file))
    assert status == 0, (out, err)
    assert "bundle intact: " in out and "2 signed checkpoints held" in out, out

    # A link's body changed in the file: the bundle's signature no longer verifies.
    document["chains"][0]["links"][0]["body"]["reason"] = "nothing happened"
    changed = tmp_path / "changed.json"
    changed.write_text(json.dumps(document))
    status, out, err = verify_offline(str(changed), PUBLIC)
    assert status == 1 and "Traceback" not in err, (out, err)
    assert "the bundle was changed after it was signed" in err, err

    # Another key: refused by name.
    other = audit_bundle.public_key_hex(Ed25519PrivateKey.generate().public_key())
    status, out, err = verify_offline(path, other)
    assert status == 1 and "the bundle is signed by another key" in err, (out, err)
    status, out, err = verify_offline(path)
    assert status == 1 and "expected --public-key KEY with --bundle" in err, (out, err)


def _resign(document: dict) -> dict:
    """`document` signed again with the key: what an exporter that checked nothing would
    write (the offline verifier must not trust the exporter either)."""
    document["signature"] = KEY.sign(audit_bundle._bundle_message(document)).hex()
    return document


@pytest.mark.django_db(transaction=True)
def test_the_offline_verifier_finds_a_rewritten_or_cut_chain_against_its_checkpoints(
        signing_key, tmp_path):
    trail("acme", "acme", "acme")
    _, document = export(tmp_path)
    entry = document["chains"][0]
    assert audit_bundle.verify_bundle(document, [KEY.public_key()]).is_intact

    cut = json.loads(json.dumps(document))
    cut["chains"][0]["links"] = entry["links"][:-2]
    last = entry["links"][-3]
    cut["chains"][0]["head"] = {"seq": last["seq"], "hash": last["hash"]}
    [found] = audit_bundle.verify_bundle(_resign(cut), [KEY.public_key()]).breaks
    assert found.seq == entry["head"]["seq"] and "the chain is shorter than" in found.message

    rechained = json.loads(json.dumps(document))
    links, prev = rechained["chains"][0]["links"], chain.GENESIS
    links[0]["body"]["reason"] = "rewritten"
    for link in links:
        link["hash"] = prev = chain.link_hash(link["body"], prev=prev, seq=link["seq"])
    rechained["chains"][0]["head"]["hash"] = prev
    [found] = audit_bundle.verify_bundle(_resign(rechained), [KEY.public_key()]).breaks
    assert found.seq == entry["head"]["seq"], found
    assert "is not the one the checkpoint signed at" in found.message, found

    forged = json.loads(json.dumps(rechained))
    forged["checkpoints"][0]["hash"] = prev  # moved to the new head, signature kept
    [found] = audit_bundle.verify_bundle(_resign(forged), [KEY.public_key()]).breaks
    assert "is forged or altered" in found.message, found


@pytest.mark.django_db(transaction=True)
def test_signed_checkpoints_catch_a_full_rechain_and_a_cut_tail_without_expect_head(
        signing_key, tmp_path):
    ops = trail("acme", "acme", "acme", "globex", "globex")
    export(tmp_path)
    acme = ChainHead.objects.get(chain="operation_events", tenant="acme")

    # globex: its newest operation deleted, the head rewound, the verifications deleted.
    before = remove_newest(ops[-1])
    # acme: one event's reason rewritten and the whole chain re-linked from seq 1.
    events = list(chain._event_rows().filter(tenant="acme", chain_seq__isnull=False)
                  .order_by("chain_seq"))
    events[0].reason = "nothing to see"
    prev, statements = chain.GENESIS, []
    for event in events:
        prev = chain.link_hash(chain.operation_event_payload(event), prev=prev,
                               seq=event.chain_seq)
        statements.append(("UPDATE ledger_operationevent SET reason = %s, chain_hash = %s "
                           "WHERE id = %s", [event.reason, prev, event.pk]))
    tamper(*statements,
           ("UPDATE ledger_chainhead SET hash = %s WHERE chain = 'operation_events' AND "
            "tenant = 'acme'", [prev]),
           ("DELETE FROM ledger_auditverification", []))
    assert not AuditVerification.objects.exists()

    # Without the key's checkpoints, the re-linked chain and the rewound head verify.
    status, out, err = verify_audit()
    assert status == 0, (out, err)
    tamper(("DELETE FROM ledger_auditverification", []))
    status, out, err = verify_audit("--public-key", PUBLIC)
    assert status == 1 and "Traceback" not in err, (out, err)
    assert (f"broken link in operation_events/acme at seq {acme.seq}" in err
            and "is not the one signed checkpoint" in err
            and "the chain was rewritten from there" in err), err
    [record] = AuditVerification.objects.all()
    [globex] = [head for head in record.heads if head["tenant"] == "globex"]
    assert not globex["is_intact"], record.heads
    assert globex["seq"] == before.chain_seq, globex  # rewound behind its checkpoint

    with pytest.raises(CommandError, match="nothing signed: expected the audit trail to "
                                           "verify before signing its heads"):
        call_command("audit_export", "--output", str(tmp_path / "refused.json"))
    assert AuditCheckpoint.objects.count() == 2  # none signed after the change


@pytest.mark.django_db(transaction=True)
def test_a_purge_keeps_the_chain_verifiable_against_a_checkpoint_in_what_it_deleted(
        signing_key, tmp_path):
    retention.set_policy("*", purge_after_days=30, redact_after_days=10,
                         user=retention_admin())
    [old] = trail("acme")
    export(tmp_path, "first.json")  # a checkpoint at old's last link
    checkpoint = AuditCheckpoint.objects.get()
    trail("acme", "acme")
    complete_days_ago(old, 31)
    retention.purge(actor="nightly")
    assert not OperationEvent.objects.filter(operation_id=old.pk).exists(), (
        "expected the purge to delete the old operation's events")

    path, document = export(tmp_path, "second.json")
    [entry] = document["chains"]
    assert entry["links"][0]["seq"] == checkpoint.seq + 1
    assert entry["anchors"] == {str(checkpoint.seq): checkpoint.hash}
    status, out, err = verify_offline(path, PUBLIC)
    assert status == 0, (out, err)
    assert "2 signed checkpoints held" in out, out  # the first export's, and the second's
    status, out, err = verify_audit("--public-key", PUBLIC)
    assert status == 0, (out, err)


@pytest.mark.django_db(transaction=True)
def test_signed_checkpoints_are_append_only_and_a_forged_one_is_named(signing_key, tmp_path):
    trail("acme")
    export(tmp_path)
    row = AuditCheckpoint.objects.get()
    with raw_connection() as raw, pytest.raises(Exception, match="Cannot update or delete"):
        raw.execute("UPDATE ledger_auditcheckpoint SET seq = 99 WHERE id = %s", [row.pk])
    tamper(("INSERT INTO ledger_auditcheckpoint (chain, tenant, seq, hash, signed_at, key_id, "
            "signature) VALUES ('operation_events', 'acme', 1, %s, now(), %s, %s)",
            [row.hash, row.key_id, "00" * 64]))
    status, out, err = verify_audit("--public-key", PUBLIC)
    assert status == 1 and "Traceback" not in err, (out, err)
    assert "found 1 forged or altered: checkpoint" in err, err
