"""The chain's columns are PostgreSQL's alone (issue 41, item 6): a writer's `chain_seq`
and `chain_hash` are refused, its `chain_format` and `content` replaced by what PostgreSQL
computes, and a signed checkpoint refused, as every role that may insert events, each in a
child process of its own login;
the sealer seals each tenant in isolation; verify_audit names a break, never a traceback."""

import json
import logging

import pytest
from django.db import DatabaseError, connection, transaction

from ledger import chain
from ledger.chain_content import content_sql
from ledger.models import ChainHead, OperationEvent
from ledger.states import State
from tests.conftest import TEST_LOGINS
from tests.factories import OperationFactory, UserFactory, reconciler_lease
from tests.ledger.test_verify_audit_tamper import tamper, verify_audit
from tests.support.chain import chain_columns_trigger
from tests.support.processes import run_as

# What each role that may insert events would forge: (state of its operation, the event's
# move, actor kind): a move its role's other checks admit, so the chain's columns are all
# that is wrong with it.
ROLES = {
    "agent": (State.SUBMITTED, State.SUCCEEDED, "agent"),
    "reconciler": (State.RECONCILING, State.SUCCEEDED, "reconciler"),
    "desk": (State.MANUAL_REVIEW, State.ABANDONED, "human"),
}

_FORGE = """
from django.db import connection, transaction

ATTEMPTS = {attempts!r}
result = {{}}
for name, (sql, params) in ATTEMPTS.items():
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(sql, params)
            result[name] = {{"stored": list(cursor.fetchone())}}
    except Exception as exc:
        cause = exc.__cause__ or exc
        result[name] = {{"sqlstate": getattr(cause, "sqlstate", None), "error": str(exc)}}
"""

_EVENT = ("INSERT INTO ledger_operationevent (operation_id, tenant, version, from_state, "
          "to_state, actor_kind, actor_id, reason, created_at, fencing_token, decided_by_id, "
          "chain_seq, chain_hash, chain_format, content) "
          "VALUES (%s, %s, %s, %s, %s, %s, 'forger', 'forged', now(), %s, %s, %s, %s, %s, %s) "
          "RETURNING chain_seq, chain_hash, chain_format, content")


def _content(op) -> dict:
    """What PostgreSQL holds the operation's content to (ledger.chain_content)."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {content_sql('o')} FROM ledger_operation o WHERE id = %s",
                       [op.pk])
        value = cursor.fetchone()[0]
    return json.loads(value) if isinstance(value, str) else value


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("role", list(ROLES))
def test_a_writer_cannot_link_its_event_or_choose_what_the_link_covers(role):
    from_state, to_state, actor_kind = ROLES[role]
    op = OperationFactory(state=from_state)
    token = reconciler_lease(op) if actor_kind == "reconciler" else None
    decided_by = UserFactory(username="rev1", role="reviewer").pk if actor_kind == "human" \
        else None
    chain.seal()
    head = ChainHead.objects.get(chain=chain.OPERATION_EVENTS.name, tenant=op.tenant)

    def event(seq, digest, chain_format, content):
        return (_EVENT, [op.pk, op.tenant, op.version + 1, from_state.value, to_state.value,
                         actor_kind,
                         token, decided_by, seq, digest, chain_format, content])

    forged_content = json.dumps({"target": "somewhere-else", "intent": "0" * 64})
    result = run_as(TEST_LOGINS[role], _FORGE.format(attempts={
        "linked at head + 1": event(head.seq + 1, "f" * 64, None, None),
        "linked, hash alone": event(None, "f" * 64, None, None),
        "format 1, forged content": event(None, None, 1, forged_content),
        "a signed checkpoint": (
            "INSERT INTO ledger_auditcheckpoint (chain, tenant, seq, hash, signed_at, key_id, "
            "signature) VALUES ('operation_events', %s, %s, %s, now(), '0123456789abcdef', "
            "%s) RETURNING id", [op.tenant, head.seq + 1, "f" * 64, "00" * 64]),
    }))

    for name in ("linked at head + 1", "linked, hash alone"):
        refused = result[name]
        assert refused.get("sqlstate") == "42501", (role, name, refused)
        assert "expected it written unsealed" in refused["error"], (role, name, refused)
    refused = result["a signed checkpoint"]  # only the key's holder, as the owner, signs
    assert refused.get("sqlstate") == "42501", (role, refused)
    assert "permission denied for table ledger_auditcheckpoint" in refused["error"], refused
    stored = result["format 1, forged content"].get("stored")
    assert stored is not None, (role, "expected the event written with PostgreSQL's own "
                                "chain columns", result["format 1, forged content"])
    seq, digest, chain_format, content = stored
    content = json.loads(content) if isinstance(content, str) else content
    assert (seq, digest, chain_format) == (None, None, chain.CURRENT_FORMAT), (role, stored)
    assert content == _content(op), (role, "expected the content PostgreSQL computed from the "
                                     "operation row", content)
    # Sealed like any other, its link covers the true content and verifies; what verify
    # reports is the lone event itself: the operation row never made that move.
    assert chain.seal() == 1
    found = chain.verify(actor="test").first_break
    forged = OperationEvent.objects.get(operation=op, version=op.version + 1)
    assert (found.seq, found.ids.get("event_id")) == (forged.chain_seq, forged.pk), found
    assert found.message == ("the operation row differs from its last event in state, "
                             "version: it was changed out of band"), found


def _forge_as_owner(sql: str, params: list) -> None:
    """An event the owner wrote with the trigger event_chain_columns off (or one written
    before it existed, migration 0043)."""
    table, trigger = OperationEvent._meta.db_table, chain_columns_trigger()
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE {table} DISABLE TRIGGER {trigger}")
        try:
            cursor.execute(sql, params)
        finally:
            cursor.execute(f"ALTER TABLE {table} ENABLE TRIGGER {trigger}")


@pytest.mark.django_db(transaction=True)
def test_one_tenants_forged_link_holds_no_other_tenant_and_verify_audit_names_it(caplog):
    acme = OperationFactory(state=State.SUBMITTED, tenant="acme")
    OperationFactory(state=State.SUBMITTED, tenant="globex")
    chain.seal()
    head = ChainHead.objects.get(chain=chain.OPERATION_EVENTS.name, tenant="acme")
    # A link at head + 1 the sealer did not write: its next seal of acme hits the unique
    # (tenant, chain_seq) and fails, every sweep.
    _forge_as_owner(_EVENT, [acme.pk, "acme", acme.version + 1, "submitted", "succeeded",
                             "agent", None, None, head.seq + 1, "f" * 64,
                             chain.CURRENT_FORMAT, None])
    waiting = OperationFactory(state=State.SUBMITTED, tenant="acme")
    later = OperationFactory(state=State.SUBMITTED, tenant="globex")
    zeta = OperationFactory(state=State.SUBMITTED, tenant="zeta")

    with caplog.at_level(logging.ERROR, logger="ledger.chain"):
        sealed = chain.seal()
    assert sealed == later.events.count() + zeta.events.count(), sealed
    assert not later.events.filter(chain_seq__isnull=True).exists()
    assert not zeta.events.filter(chain_seq__isnull=True).exists()
    assert waiting.events.filter(chain_seq__isnull=True).exists()
    [failure] = [r.getMessage() for r in caplog.records if r.name == "ledger.chain"]
    assert "sealing tenant 'acme' failed" in failure and "IntegrityError" in failure, failure

    status, out, err = verify_audit()
    assert status == 1, (out, err)
    assert "Traceback" not in err, err
    assert (f"broken link in operation_events/acme at seq {head.seq + 1}" in err
            and "the stored hash does not match the row and the previous link" in err), err


@pytest.mark.django_db(transaction=True)
def test_a_link_of_an_older_format_after_a_newer_one_is_a_break():
    op = OperationFactory(state=State.SUBMITTED)
    # Format 1 covers neither external_id nor content: written (as the owner, the trigger
    # off) after format 3 links, and sealed, its link verifies, its format does not.
    _forge_as_owner(_EVENT, [op.pk, op.tenant, op.version + 1, "submitted", "succeeded",
                             "agent", None, None, None, None, 1, None])
    forged = OperationEvent.objects.get(operation=op, version=op.version + 1)
    status, out, err = verify_audit()
    assert status == 1, (out, err)
    assert "Traceback" not in err, err
    forged.refresh_from_db()
    assert (f"broken link in operation_events/default at seq {forged.chain_seq} (event_id "
            f"{forged.pk}, operation_id {op.operation_id}): the link's chain format went back "
            f"from {chain.CURRENT_FORMAT} to 1") in err, err


# --- what the chain covers of an operation (issue 41, item 7) ---------------------------------

# Each column of an operation, rewritten with every trigger off (column -> (SQL expression
# of the new value, the name verify_audit reports)). Format 4's content covers them all
# (and authentication_recorded, which a CHECK constraint holds false even for the owner).
OPERATION_REWRITES = {
    "operation": ("'payments.refund'", "operation"),
    "tenant": ("'elsewhere'", "tenant"),
    "run_id": ("{run}", "run"),
    "relies_on": ("'[\"fact:forged\"]'::jsonb", "relies_on"),
    "attempt": ("attempt + 4", "attempt"),
    "created_at": ("created_at - interval '1 day'", "created_at"),
    "submitted_at": ("COALESCE(submitted_at, now()) + interval '1 hour'", "submitted_at"),
    "in_flight_until": ("COALESCE(in_flight_until, now()) + interval '1 hour'",
                        "in_flight_until"),
    "completed_at": ("COALESCE(completed_at, now()) + interval '1 hour'", "completed_at"),
    "error_code": ("'forged'", "error_code"),
    "error_detail": ("'the charge went through twice'", "error_detail"),
    "conflict": ("'duplicate'", "conflict"),
    "trace_id": ("'0123456789abcdef0123456789abcdef'", "trace_id"),
    "span_id": ("'0123456789abcdef'", "span_id"),
    "unknown_since": ("COALESCE(unknown_since, now()) + interval '1 hour'", "unknown_since"),
    "next_attempt_at": ("COALESCE(next_attempt_at, now()) + interval '1 hour'",
                        "next_attempt_at"),
    "reconcile_attempts": ("reconcile_attempts + 3", "reconcile_attempts"),
    "reconcile_failures": ("reconcile_failures + 3", "reconcile_failures"),
    "reread_due_at": ("COALESCE(reread_due_at, now()) + interval '1 hour'", "reread_due_at"),
    "result_unstorable": ("'forged'", "result_unstorable"),
}


@pytest.mark.django_db(transaction=True)
def test_each_rewrite_of_an_operation_column_is_reported_by_operation_and_column():
    from tests.factories import RunFactory

    ops = {column: OperationFactory(state=State.SUCCEEDED) for column in OPERATION_REWRITES}
    run = RunFactory()
    chain.seal()
    assert chain.verify(actor="before").is_intact
    tamper(*[(f"UPDATE ledger_operation SET {column} = {value.format(run=run.pk)} "
              "WHERE id = %s", [ops[column].pk])
             for column, (value, _) in OPERATION_REWRITES.items()])
    status, out, err = verify_audit()
    assert status == 1 and "Traceback" not in err, (out, err)
    lines = {line.split(" ")[1]: line for line in err.splitlines()
             if line.startswith("operation ")}
    missed = []
    for column, (_, name) in OPERATION_REWRITES.items():
        line = lines.get(ops[column].operation_id, "")
        if f"the operation row differs from its last event in {name}: it was changed out " \
                "of band" not in line:
            missed.append((column, line or "not reported"))
    assert not missed, (missed, err)


# --- the fact decisions' and the records' chains: PostgreSQL's alone too ---------------------

_DECISION = ("INSERT INTO ledger_factdecision (tenant, conflict_id, chosen_id, written_id, "
             "user_id, username, reason, created_at, chain_seq, chain_hash) "
             "SELECT tenant, conflict_id, chosen_id, written_id, user_id, username, 'forged', "
             "now(), %s, %s FROM ledger_factdecision WHERE id = %s RETURNING id")
_RECORD = ("INSERT INTO ledger_recordlink (tenant, source, row_id, action, content, "
           "created_at) VALUES ('default', 'operation_note', 1, 'insert', '{}'::jsonb, now()) "
           "RETURNING id")


def _linked_decision():
    from tests.ledger.test_audit_chain import decide_a_conflict

    decision = decide_a_conflict("order-1")
    chain.seal()
    return decision, ChainHead.objects.get(chain=chain.FACT_DECISIONS.name, tenant="default")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("role", ["agent", "desk", "reconciler"])
def test_no_role_links_a_fact_decision_writes_a_record_link_or_moves_a_head(role):
    decision, head = _linked_decision()
    result = run_as(TEST_LOGINS[role], _FORGE.format(attempts={
        "decision linked at head + 1": (_DECISION, [head.seq + 1, "f" * 64, decision.pk]),
        "decision with a hash alone": (_DECISION, [None, "f" * 64, decision.pk]),
        "a record link": (_RECORD, []),
        "a head moved": ("UPDATE ledger_chainhead SET seq = seq + 1 WHERE chain = "
                         "'fact_decisions' RETURNING seq", []),
        "the sealer's function": (
            "SELECT ledger_seal_links('fact_decisions', 'default', ARRAY[%s]::bigint[], "
            "ARRAY[%s]::varchar[], %s, %s)", [decision.pk, "f" * 64, head.seq, head.hash]),
    }))
    if role == "reconciler":  # the sealer's role: its function relinks nothing sealed
        refused = result.pop("the sealer's function")
        assert refused.get("sqlstate") == "23514", refused
        assert "expected 1 unsealed rows of fact_decisions/default" in refused["error"], refused
    for name, refused in result.items():
        assert refused.get("sqlstate") == "42501", (role, name, refused)
    if role == "desk":  # the one role that writes decisions: PostgreSQL's own refusal
        for name in ("decision linked at head + 1", "decision with a hash alone"):
            assert "expected it written unsealed" in result[name]["error"], result[name]
    # ...and a decision the desk writes unsealed is linked by the sealer, and verifies.
    head.refresh_from_db()
    assert head.seq == 1 and chain.verify(actor="test").is_intact


@pytest.mark.django_db(transaction=True)
def test_the_owner_cannot_link_a_fact_decision_or_write_a_record_link_either():
    decision, head = _linked_decision()
    for sql, params, says in (
            (_DECISION, [head.seq + 1, "f" * 64, decision.pk], "expected it written unsealed"),
            (_DECISION, [None, "f" * 64, decision.pk], "expected it written unsealed"),
            (_RECORD, [], "expected it written by PostgreSQL"),
            ("UPDATE ledger_factdecision SET chain_seq = chain_seq + 1 WHERE id = %s",
             [decision.pk], "Cannot update or delete rows from ledger_factdecision")):
        with pytest.raises(DatabaseError, match=says), transaction.atomic(), \
                connection.cursor() as cursor:
            cursor.execute(sql, params)


@pytest.mark.django_db(transaction=True)
def test_each_roles_writes_are_recorded_by_postgresql_whatever_the_role_may_not_write():
    """The agent's fact and approval request and the desk's note are each recorded by a link
    PostgreSQL writes (the roles have no privilege on ledger_recordlink), and verify."""
    from ledger import claims
    from ledger.models import OperationNote, RecordLink

    op = OperationFactory(state=State.PLANNED, operation="payments.send")
    agent = run_as(TEST_LOGINS["agent"], f"""
from ledger import approvals, facts
from ledger.models import Operation
fact = facts.assert_fact("invoice:1", "status", "sent", source="billing")
approvals.request(Operation.objects.get(pk={op.pk}), note="please")
result = {{"fact": fact.pk, "request": Operation.objects.get(pk={op.pk}).approval_request.pk}}
""")
    reviewer = UserFactory(username="rev1", role="reviewer")
    note = claims.add_note(op, user=reviewer, text="checked")
    desk = run_as(TEST_LOGINS["desk"], f"""
from django.db import connection
with connection.cursor() as cursor:
    cursor.execute("INSERT INTO ledger_operationnote (operation_id, tenant, author_id, "
                   "author_name, text, created_at) SELECT operation_id, tenant, author_id, "
                   "author_name, 'second look', now() FROM ledger_operationnote "
                   "WHERE id = {note.pk} RETURNING id")
    result = {{"note": cursor.fetchone()[0]}}
""")
    written = {(source, row) for source, row in RecordLink.objects.filter(
        action="insert").values_list("source", "row_id")}
    assert {("fact", agent["fact"]), ("approval_request", agent["request"]),
            ("operation_note", desk["note"])} <= written, written
    assert OperationNote.objects.filter(pk=desk["note"]).exists()
    assert chain.verify(actor="test").is_intact
