"""verify_audit against a superuser who tampers behind the triggers: the newest links
removed and the head rewound, evidence rewritten, operation rows changed without an event;
and the heads kept outside the database (--export-head, --expect-head)."""

import json

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from ledger import chain, reconcile, retention, transitions
from ledger.models import AuditVerification, ChainHead, Evidence, Operation, OperationEvent
from ledger.states import State
from tests.factories import OperationFactory, UserFactory, add_evidence, reconciler_lease
from tests.support.chain import written_in_format
from tests.support.processes import spawn
from tests.support.retention import complete_days_ago, raw_connection, retention_admin


def tamper(*statements):
    """Run `statements` ((sql, params) pairs) as a superuser would, every trigger off."""
    with raw_connection() as raw:
        raw.execute("SET session_replication_role = replica")
        for sql, params in statements:
            raw.execute(sql, params)


def verify_audit(*args):
    """manage.py verify_audit in a child process: (exit status, stdout, stderr)."""
    child = spawn(f"""
        from django.core.management import execute_from_command_line
        execute_from_command_line(["manage.py", "verify_audit", *{list(args)!r}])
    """)
    out, err = child.communicate(timeout=180)
    return child.returncode, out, err


@reconcile.register("test.tamper")
class FoundIt(reconcile.Reconciler):
    def lookup(self, op):
        return reconcile.Found(f"article-{op.intent['n']}", {"status": "live", "n": op.intent["n"]})


def reconciled(n, **kwargs):
    """An operation the reconciler settled: its Evidence row is sealed by the verdict's event."""
    op = OperationFactory(state=State.OUTCOME_UNKNOWN, operation="test.tamper",
                          intent={"n": n}, **kwargs)
    reconcile.run_once(worker="w1")
    op.refresh_from_db()
    assert (op.state, op.external_id) == (State.SUCCEEDED, f"article-{n}")
    return op


def trail():
    """Two tenants, settled by agents and by the reconciler (with evidence)."""
    ops = [OperationFactory(state=State.SUCCEEDED), reconciled(1),
           OperationFactory(state=State.SUCCEEDED, tenant="acme"), reconciled(2, tenant="acme"),
           OperationFactory(state=State.MANUAL_REVIEW, tenant="acme")]
    chain.seal()  # the chain covers what the sealer linked: tampering comes after
    return ops


def broken(**kwargs):
    result = chain.verify(actor="test", **kwargs)
    assert not result.is_intact
    return result.first_break


# --- the untampered trail ------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_an_untampered_trail_passes_exports_its_heads_and_extends_them(tmp_path):
    ops = trail()
    event = OperationEvent.objects.filter(operation=ops[1]).order_by("-version").first()
    evidence = Evidence.objects.get(operation=ops[1])
    assert (event.chain_format, event.external_id) == (chain.CURRENT_FORMAT, "article-1")
    assert event.evidence_seal["id"] == evidence.pk

    heads = tmp_path / "heads.json"
    status, out, err = verify_audit("--actor", "first", "--export-head", str(heads))
    assert status == 0, (out, err)
    assert "audit trail intact" in out and "5 operations and 2 evidence rows" in out
    exported = json.loads(heads.read_text())
    assert exported["heads"]["operation_events"] == {
        head.tenant: {"seq": head.seq, "hash": head.hash}
        for head in ChainHead.objects.filter(chain="operation_events")
    }
    OperationFactory(state=State.SUBMITTED, tenant="acme")  # the chain grows: still extends
    status, out, err = verify_audit("--expect-head", str(heads))
    assert status == 0, (out, err)
    assert f"every head extends {heads}" in out
    record = AuditVerification.objects.order_by("-id").first()
    by_tenant = {h["tenant"]: h for h in record.heads if h["chain"] == "operation_events"}
    assert (by_tenant["acme"]["operations_checked"], by_tenant["acme"]["evidence_checked"]) == (
        4, 1)


@pytest.mark.django_db
def test_sealed_evidence_with_numbers_jsonb_rewrites_still_verifies():
    op = OperationFactory(state=State.RECONCILING)
    row = add_evidence(op, verdict="found", to_state=State.SUCCEEDED, detail="ok\r\nü",
                       query={"tuple": (1, 2), "nested": {"b": [0.1, 2 ** 70], "a": None}},
                       observed={"big": 1e20, "odd": 1.2345e21, "zero": -0.0, "small": 1e-7})
    assert OperationEvent.objects.get(evidence_seal__id=row.pk).operation_id == op.pk
    result = chain.verify(actor="test")
    assert result.is_intact, result.first_break


@pytest.mark.django_db(transaction=True)
def test_a_redacted_evidence_row_still_verifies_but_not_once_rewritten():
    retention.set_policy("*", purge_after_days=30, redact_after_days=10,
                         user=retention_admin())
    op = OperationFactory(state=State.RECONCILING)
    row = add_evidence(op, verdict="found", to_state=State.SUCCEEDED, detail="title matched",
                       observed={"title": "Secret plan", "price": 1e20})
    complete_days_ago(op, 11)
    retention.purge(actor="nightly")
    row.refresh_from_db()
    assert row.redacted_at is not None and row.query == retention.REDACTED_PAYLOAD
    assert chain.verify(actor="test").is_intact

    tamper(("UPDATE ledger_evidence SET verdict = 'proven_absent' WHERE id = %s", [row.pk]))
    found = broken()
    assert (found.ids["evidence_id"], found.tenant) == (row.pk, "default")
    assert "rewritten out of band" in found.message


# --- (a) the newest links removed and the head rewound ---------------------------------------


def remove_newest(op):
    """Delete `op` (the newest operation of its tenant) with its events, and rewind the
    tenant's chain head to the link before them: the chain alone still verifies."""
    first = OperationEvent.objects.filter(operation=op).order_by("chain_seq").first()
    before = OperationEvent.objects.get(tenant=op.tenant, chain_seq=first.chain_seq - 1)
    tamper(
        ("DELETE FROM ledger_evidence WHERE operation_id = %s", [op.pk]),
        ("DELETE FROM ledger_operationevent WHERE operation_id = %s", [op.pk]),
        ("DELETE FROM ledger_operation WHERE id = %s", [op.pk]),
        ("UPDATE ledger_chainhead SET seq = %s, hash = %s WHERE chain = 'operation_events' "
         "AND tenant = %s", [before.chain_seq, before.chain_hash, op.tenant]),
    )
    return before


@pytest.mark.django_db(transaction=True)
def test_a_rewound_head_is_found_through_the_head_an_earlier_verification_recorded():
    ops = trail()
    verified = chain.verify(actor="nightly").record
    recorded = ChainHead.objects.get(chain="operation_events", tenant="acme")
    before = remove_newest(ops[-1])
    found = broken()
    assert (found.chain, found.tenant, found.seq) == ("operation_events", "acme", recorded.seq)
    assert found.expected == f"{recorded.seq}:{recorded.hash}"
    assert found.found == f"{before.chain_seq}:{before.chain_hash}"
    assert f"shorter than verification {verified.pk}" in found.message
    assert f"went back from seq {recorded.seq} to {before.chain_seq}" in found.message

    # Writing on past the rewound head does not hide it: the link at the recorded seq is
    # another one now.
    while ChainHead.objects.get(tenant="acme").seq < recorded.seq:
        OperationFactory(state=State.SUCCEEDED, tenant="acme")
        chain.seal()
    found = broken()
    assert (found.tenant, found.seq, found.expected) == ("acme", recorded.seq, recorded.hash)
    assert "rewritten from there" in found.message


@pytest.mark.django_db(transaction=True)
def test_a_rewound_head_is_found_through_expect_head_when_the_records_are_gone_too(tmp_path):
    ops = trail()
    heads = tmp_path / "heads.json"
    call_command("verify_audit", actor="nightly", export_head=str(heads))
    recorded = ChainHead.objects.get(chain="operation_events", tenant="acme")
    before = remove_newest(ops[-1])
    tamper(("DELETE FROM ledger_auditverification", []))
    assert chain.verify(actor="without the file").is_intact  # nothing in the database tells

    status, out, err = verify_audit("--expect-head", str(heads))
    assert status == 1, (out, err)
    assert (f"broken link in operation_events/acme at seq {recorded.seq}: the chain is "
            f"shorter than --expect-head {heads} recorded") in err
    assert f"expected {recorded.seq}:{recorded.hash}, found " \
           f"{before.chain_seq}:{before.chain_hash}" in err


@pytest.mark.django_db(transaction=True)
def test_expect_head_names_a_chain_that_is_gone_and_a_malformed_file(tmp_path):
    trail()
    heads = tmp_path / "heads.json"
    call_command("verify_audit", actor="nightly", export_head=str(heads))
    tamper(("DELETE FROM ledger_chainhead WHERE tenant = 'acme'", []),
           ("DELETE FROM ledger_auditverification", []))
    with pytest.raises(CommandError, match=r"operation_events/acme .*the chain --expect-head "
                                           r".* recorded is gone: its head row is missing"):
        call_command("verify_audit", expect_head=str(heads))

    bad = tmp_path / "bad.json"
    bad.write_text('{"heads": {"operation_events": {"acme": {"seq": 0, "hash": "x"}}}}')
    with pytest.raises(CommandError, match=r"expected heads.operation_events.acme in "
                                           r"--expect-head .* found \{\"hash\":\"x\",\"seq\":0\}"):
        call_command("verify_audit", expect_head=str(bad))
    with pytest.raises(CommandError, match=r"expected --expect-head .*missing.json to be a "
                                           r"readable file, found"):
        call_command("verify_audit", expect_head=str(tmp_path / "missing.json"))


# --- (b) evidence rewritten, removed, inserted ----------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_rewritten_evidence_row_is_found_and_named():
    ops = trail()
    row = Evidence.objects.get(operation=ops[3])
    event = OperationEvent.objects.get(operation=ops[3], evidence_seal__id=row.pk)
    tamper(("UPDATE ledger_evidence SET observed = '{\"status\": \"gone\"}'::jsonb "
            "WHERE id = %s", [row.pk]))
    status, out, err = verify_audit()
    assert status == 1, (out, err)
    assert (f"broken link in operation_events/acme at seq {event.chain_seq} (evidence_id "
            f"{row.pk}, operation_id {ops[3].operation_id}, event_id {event.pk}): the "
            "evidence row differs from the seal its event carries") in err
    assert f"expected {event.evidence_seal['digest']}" in err


@pytest.mark.django_db(transaction=True)
def test_a_deleted_or_inserted_evidence_row_is_found():
    ops = trail()
    row = Evidence.objects.get(operation=ops[1])
    tamper(("DELETE FROM ledger_evidence WHERE id = %s", [row.pk]))
    found = broken()
    assert (found.tenant, found.ids["evidence_id"]) == ("default", row.pk)
    assert "deleted out of band" in found.message

    tamper(("INSERT INTO ledger_evidence (operation_id, reconciler, query, observed, verdict, "
            "matched_by, detail, created_at) SELECT operation_id, reconciler, query, "
            "observed, verdict, matched_by, detail, created_at FROM ledger_evidence "
            "WHERE operation_id = %s", [ops[3].pk]))
    forged = Evidence.objects.filter(operation=ops[3]).order_by("-id").first()
    found = broken()
    assert found.tenant == "acme" and found.ids["evidence_id"] == forged.pk
    assert "inserted out of band" in found.message


# --- (c) operation rows changed without an event ---------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("column", "value"), [("external_id", "forged"),
                                               ("state", State.SUCCEEDED)])
def test_an_operation_row_changed_without_an_event_is_found(column, value):
    ops = trail()
    victim = ops[-1] if column == "state" else ops[3]  # manual_review; reconciled
    last = OperationEvent.objects.filter(operation=victim).order_by("-version").first()
    tamper((f"UPDATE ledger_operation SET {column} = %s WHERE id = %s", [value, victim.pk]))
    status, out, err = verify_audit()
    assert status == 1, (out, err)
    assert (f"broken link in operation_events/acme at seq {last.chain_seq} (operation_id "
            f"{victim.operation_id}, event_id {last.pk}): the operation row differs from its "
            "last event") in err
    expected = {"state": last.to_state, "version": last.version, "external_id": last.external_id}
    found = {**expected, column: value}
    assert ("expected state {state}, version {version}, external_id {external_id!r}, "
            "found state {found[state]}, version {found[version]}, external_id "
            "{found[external_id]!r}").format(**expected, found=found) in err


@pytest.mark.django_db(transaction=True)
def test_a_state_moved_with_its_version_but_no_event_is_found():
    op = OperationFactory(state=State.MANUAL_REVIEW)
    tamper(("UPDATE ledger_operation SET state = 'succeeded', version = version + 1 "
            "WHERE id = %s", [op.pk]))
    found = broken()
    assert found.ids["operation_id"] == op.operation_id
    assert found.found.startswith(f"state succeeded, version {op.version + 1}")


# --- (d) what a receipt says, rewritten (chain format 3) -------------------------------------

# column rewritten -> (value, the name verify_audit gives what differs)
RECEIPT_REWRITES = {
    "target": ("https://elsewhere.example/api", "target"),
    "account": ("acct_forged", "account"),
    "intent": ('{"title": "forged"}', "intent"),
    "intent_fingerprint": ("sha256:forged", "fingerprint"),
    "idempotency_key": ("forged-key", "key"),
    "retry_policy": ("never", "retry_policy"),
    "result": ('{"id": "forged"}', "result"),
    "external_id": ("forged-id", "external_id"),
}


@pytest.mark.django_db(transaction=True)
def test_each_rewrite_of_what_a_receipt_says_is_reported_by_operation_and_field():
    ops = {column: OperationFactory(state=State.SUCCEEDED) for column in RECEIPT_REWRITES}
    chain.seal()
    assert chain.verify(actor="before").is_intact
    tamper(*[(f"UPDATE ledger_operation SET {column} = %s{'::jsonb' * (value[0] == '{')} "
              "WHERE id = %s", [value, ops[column].pk])
             for column, (value, _) in RECEIPT_REWRITES.items()])
    status, out, err = verify_audit()
    assert status == 1, (out, err)
    for column, (_, name) in RECEIPT_REWRITES.items():
        op = ops[column]
        last = OperationEvent.objects.filter(operation=op).order_by("-version").first()
        assert (f"operation {op.operation_id} (default, last event {last.pk} at seq "
                f"{last.chain_seq}): the operation row differs from its last event in {name}: "
                "it was changed out of band") in err, (column, err)
    [head] = AuditVerification.objects.order_by("-id").first().heads
    assert head["operations_differing"] == len(RECEIPT_REWRITES)


@pytest.mark.django_db(transaction=True)
def test_a_format_3_link_covers_its_content_and_format_2_events_verify_as_written():
    with written_in_format(2):
        old = OperationFactory(state=State.SUCCEEDED)
    new = OperationFactory(state=State.SUCCEEDED)
    assert set(OperationEvent.objects.filter(operation=old)
               .values_list("chain_format", "content")) == {(2, None)}
    last = OperationEvent.objects.filter(operation=new).order_by("-version").first()
    assert (last.chain_format, last.content["key"], last.content["target"]) == (
        chain.CURRENT_FORMAT, new.idempotency_key, new.target)
    result = chain.verify(actor="test")
    assert result.is_intact, result.first_break
    assert result.record.heads[0]["operations_content_unchecked"] == 1

    # Format 2 does not cover the content: its operation's intent is not held to it.
    tamper(("UPDATE ledger_operation SET intent = '{}' WHERE id = %s", [old.pk]))
    assert chain.verify(actor="test").is_intact
    # Format 3 does, in the link: an event's content rewritten breaks its link.
    tamper(("UPDATE ledger_operationevent SET content = content || '{\"target\": \"x\"}' "
            "WHERE id = %s", [last.pk]))
    found = broken()
    last.refresh_from_db()  # sealed by the first verification
    assert (found.seq, found.ids["event_id"]) == (last.chain_seq, last.pk)
    assert "the stored hash does not match" in found.message


# --- events written before chain format 2 ------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_events_and_evidence_written_before_format_2_verify_the_old_way():
    with written_in_format(1):
        old = OperationFactory(state=State.RECONCILING)
        row = Evidence.objects.create(operation=old, reconciler="r", verdict="found",
                                      matched_by="fingerprint", created_at=old.created_at)
        transitions._apply(old, State.SUCCEEDED, actor_kind="reconciler", actor_id="w",
                           fencing_token=reconciler_lease(old, "w"),
                           reason="found", changes={"external_id": "a-1"},
                           evidence={"verdict": "found", "reconciler": "r",
                                     "matched_by": "fingerprint"})
    assert set(OperationEvent.objects.filter(operation=old)
               .values_list("chain_format", flat=True)) == {1}
    new = reconciled(3)
    result = chain.verify(actor="test")
    assert result.is_intact, result.first_break
    [head] = result.record.heads
    assert (head["evidence_checked"], head["evidence_before_seals"]) == (2, 1)
    assert head["operations_external_id_unchecked"] == 1
    assert new.external_id == "article-3"

    # A format 1 event covers the verdict of its evidence: changing that is found.
    tamper(("UPDATE ledger_evidence SET verdict = 'proven_absent' WHERE id = %s", [row.pk]))
    found = broken()
    assert found.ids == {"evidence_id": row.pk, "operation_id": old.operation_id}
    assert "inserted out of band" in found.message
    assert Operation.objects.get(pk=old.pk).external_id == "a-1"


def test_the_recorded_heads_are_the_longest_intact_ones(db):
    OperationFactory(state=State.SUCCEEDED)
    first = chain.verify(actor="one").record
    OperationFactory(state=State.SUCCEEDED)
    second = chain.verify(actor="two").record
    AuditVerification.objects.create(  # a broken verification vouches for nothing
        actor="broken", started_at=second.started_at, finished_at=second.finished_at,
        links_checked=0, is_intact=False,
        heads=[{"chain": "operation_events", "tenant": "default", "seq": 99, "hash": "f" * 64,
                "is_intact": False}],
    )
    recorded = chain._recorded_heads()
    assert list(recorded) == [("operation_events", "default")]
    checkpoint = recorded[("operation_events", "default")]
    assert (checkpoint.seq, checkpoint.hash) == (6, second.heads[0]["hash"])
    assert f"verification {second.pk} (" in checkpoint.source and first.pk != second.pk
    assert chain.verify(actor="three").is_intact


# --- (e) the rows people rely on beside the operations (the records chain) ---------------------


def people_records(reviewer, admin):
    """Two of each row the records chain covers, written through the ledger: approval
    requests and approvals, desk notes, tenant grants and their log, facts in versions and
    a person's decision on a conflict."""
    from ledger import access, approvals, claims
    from ledger.models import (
        Approval,
        ApprovalRequest,
        Fact,
        FactDecision,
        OperationNote,
        TenantAccessChange,
    )
    from tests.ledger.test_audit_chain import decide_a_conflict

    approvals.set_policy("payments.*", user=admin)
    ops = [OperationFactory(operation="payments.send", intent={"to": "acct-1", "amount": n})
           for n in (100, 200, 300)]
    for op in ops:
        approvals.request(op, note=f"invoice {op.intent['amount']}")
    for op in ops[:2]:
        approvals.approve(op, user=reviewer, reason="invoice checked")
    for n in (1, 2):
        claims.add_note(ops[0], user=reviewer, text=f"called the bank ({n})")
    for name in ("ada", "bob"):
        access.grant(UserFactory(username=name), "default")
    decide_a_conflict("order-1")
    decide_a_conflict("order-2")
    rows = {
        "requests": list(ApprovalRequest.objects.order_by("id")),
        "approvals": list(Approval.objects.order_by("id")),
        "notes": list(OperationNote.objects.order_by("id")),
        "access": list(TenantAccessChange.objects.filter(tenant="default").order_by("id")),
        "superseded": list(Fact.objects.filter(status="superseded").order_by("id")),
        "current": list(Fact.objects.filter(status="current").order_by("id")),
        "decisions": list(FactDecision.objects.order_by("id")),
    }
    chain.seal()
    return ops, rows


# name -> (rows, index, statement with %s for the row's id, the record's source, what the
# report says of it)
RECORD_REWRITES = {
    "approval request rewritten": (
        "requests", 0, "UPDATE ledger_approvalrequest SET approvals_needed = 0, "
        "status = 'pending' WHERE id = %s", "approval_request",
        "differs from its last record link in approvals_needed, status"),
    "approval request deleted": (
        "requests", 1, "DELETE FROM ledger_approvalrequest WHERE id = %s", "approval_request",
        "is gone but its last record link says it was updated: it was deleted out of band"),
    "approval decision rewritten": (
        "approvals", 0, "UPDATE ledger_approval SET decision = 'deny', reason = 'no' "
        "WHERE id = %s", "approval", "differs from its last record link in decision, reason"),
    "approval deleted": (
        "approvals", 1, "DELETE FROM ledger_approval WHERE id = %s", "approval",
        "is gone but its last record link says it was inserted: it was deleted out of band"),
    "desk note rewritten": (
        "notes", 0, "UPDATE ledger_operationnote SET text = 'all fine' WHERE id = %s",
        "operation_note", "differs from its last record link in text"),
    "desk note deleted": (
        "notes", 1, "DELETE FROM ledger_operationnote WHERE id = %s", "operation_note",
        "deleted out of band"),
    "tenant-access log rewritten": (
        "access", 0, "UPDATE ledger_tenantaccesschange SET username = 'mallory' WHERE id = %s",
        "tenant_access_change", "differs from its last record link in username"),
    "tenant-access log deleted": (
        "access", 1, "DELETE FROM ledger_tenantaccesschange WHERE id = %s",
        "tenant_access_change", "deleted out of band"),
    "fact value rewritten": (
        "current", 0, "UPDATE ledger_fact SET value = '\"paid\"'::jsonb WHERE id = %s",
        "fact", "differs from its last record link in value"),
    "superseded fact version rewritten": (
        "superseded", 1, "UPDATE ledger_fact SET value = '\"refunded\"'::jsonb, "
        "source = 'agent-b' WHERE id = %s", "fact",
        "differs from its last record link in source, value"),
    "fact decision deleted": (
        "decisions", 1, "DELETE FROM ledger_factdecision WHERE id = %s", "fact_decision",
        "deleted out of band"),
}


@pytest.mark.django_db(transaction=True)
def test_each_rewrite_or_delete_of_a_row_people_rely_on_is_reported(reviewer, admin_user):
    _, rows = people_records(reviewer, admin_user)
    assert chain.verify(actor="before").is_intact
    targets = {name: rows[group][index] for name, (group, index, *_) in RECORD_REWRITES.items()}
    tamper(*[(sql, [targets[name].pk]) for name, (_, _, sql, *_) in RECORD_REWRITES.items()])
    status, out, err = verify_audit()
    assert status == 1 and "Traceback" not in err, (out, err)
    missed = []
    for name, (_, _, _, source, says) in RECORD_REWRITES.items():
        lines = [line for line in err.splitlines()
                 if line.startswith(f"record {source} {targets[name].pk} (default")]
        if not any(says in line for line in lines):
            missed.append((name, lines or "not reported"))
    assert not missed, (missed, err)


@pytest.mark.django_db(transaction=True)
def test_a_row_inserted_out_of_band_or_changed_before_a_later_change_is_reported(
        reviewer, admin_user):
    from ledger import approvals
    from ledger.models import OperationNote

    ops, rows = people_records(reviewer, admin_user)
    note = rows["notes"][0]
    # A note no link accounts for; and a pending request rewritten, then approved through
    # the desk: the approval's link records the forged note as the row's "before".
    tamper(("INSERT INTO ledger_operationnote (operation_id, tenant, author_id, author_name, "
            "text, created_at) SELECT operation_id, tenant, author_id, author_name, "
            "'the agent did nothing wrong', created_at FROM ledger_operationnote WHERE id = %s",
            [note.pk]),
           ("UPDATE ledger_approvalrequest SET note = 'forged' WHERE id = %s",
            [rows["requests"][2].pk]))
    forged = OperationNote.objects.order_by("-id").first()
    approvals.approve(ops[2], user=reviewer, reason="looks right")
    status, out, err = verify_audit()
    assert status == 1 and "Traceback" not in err, (out, err)
    assert (f"record operation_note {forged.pk} (default): the operation note row has no "
            "record link: it was inserted out of band") in err, err
    request = rows["requests"][2].pk
    assert any(line.startswith(f"record approval_request {request} (default, last link ")
               and "was changed out of band before this update (in note)" in line
               for line in err.splitlines()), err


@pytest.mark.django_db(transaction=True)
def test_a_records_chain_relinked_after_the_verifications_are_deleted_is_found_by_its_checkpoint(
        reviewer, admin_user, settings, tmp_path):
    from ledger import audit_bundle
    from ledger.models import RecordLink
    from tests.ledger.test_audit_bundle import KEY, PUBLIC, SEED

    settings.LEDGER_AUDIT_SIGNING_KEY = SEED
    _, rows = people_records(reviewer, admin_user)
    audit_bundle.export(KEY)  # signs every chain's head, the records chain's too
    signed = ChainHead.objects.get(chain="records", tenant="default")
    note = rows["notes"][0]
    # The note rewritten, its links' content recomputed to match, the chain re-linked from
    # seq 1 and the head moved: the records chain alone verifies again.
    tamper(("UPDATE ledger_operationnote SET text = 'all fine' WHERE id = %s", [note.pk]),
           ("UPDATE ledger_recordlink l SET content = ledger_record_content(n) FROM "
            "ledger_operationnote n WHERE l.source = 'operation_note' AND l.row_id = n.id "
            "AND n.id = %s", [note.pk]))
    prev, statements = chain.GENESIS, []
    for link in RecordLink.objects.filter(tenant="default").order_by("chain_seq"):
        prev = chain.link_hash(chain.record_link_payload(link), prev=prev, seq=link.chain_seq)
        statements.append(("UPDATE ledger_recordlink SET chain_hash = %s WHERE id = %s",
                           [prev, link.pk]))
    tamper(*statements,
           ("UPDATE ledger_chainhead SET hash = %s WHERE chain = 'records' AND "
            "tenant = 'default'", [prev]),
           ("DELETE FROM ledger_auditverification", []))
    settings.LEDGER_AUDIT_SIGNING_KEY = ""
    assert chain.verify(actor="without the key").is_intact  # nothing else in the database tells
    tamper(("DELETE FROM ledger_auditverification", []))
    status, out, err = verify_audit("--public-key", PUBLIC)
    assert status == 1 and "Traceback" not in err, (out, err)
    assert (f"broken link in records/default at seq {signed.seq}" in err
            and "is not the one signed checkpoint" in err), err


@pytest.mark.django_db(transaction=True)
def test_what_the_purge_deletes_is_recorded_and_the_records_still_verify(reviewer, admin_user):
    from ledger import approvals, claims
    from ledger.models import OperationNote, RecordLink
    from tests.factories import drive

    approvals.set_policy("payments.*", user=admin_user)
    op = OperationFactory(operation="payments.send", intent={"to": "acct-1", "amount": 5})
    approvals.request(op, note="small refund")
    approvals.approve(op, user=reviewer, reason="fine")
    op = drive(op, State.SUCCEEDED)
    note = claims.add_note(op, user=reviewer, text="refund sent")
    retention.set_policy("*", purge_after_days=30, user=retention_admin())
    complete_days_ago(op, 40)
    retention.purge(actor="nightly")
    assert not OperationNote.objects.filter(pk=note.pk).exists()
    deleted = set(RecordLink.objects.filter(action="delete").values_list("source", flat=True))
    assert deleted == {"operation_note", "approval_request", "approval"}, deleted
    result = chain.verify(actor="after the purge")
    assert result.is_intact, (result.first_break, result.records_differing)
