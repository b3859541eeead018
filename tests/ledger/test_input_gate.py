"""The one input gate (ledger/inputs.py), swept over every public entry point: a bad value
in any argument is refused with InvalidInput naming the argument (or the JSON path), before
any query writes anything, and the connection stays usable."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.apps import apps
from django.contrib.auth import get_user_model
from django.db import connection

from ledger import (
    access,
    agent_keys,
    agent_kit,
    episodes,
    facts,
    inputs,
    leases,
    obligations,
    receipts,
    reconcile,
    retention,
    runs,
)
from ledger.errors import InvalidInput

pytestmark = pytest.mark.django_db
User = get_user_model()

# A bad identifier, by kind. Each is refused wherever a name is expected.
BAD_NAMES = {
    "nul": "acme\x00evil",
    "surrogate": "acme\ud800",
    "padded": " acme ",
    "newline": "articles.create\n",
}


def _deep(n: int) -> list:
    value: list = []
    for _ in range(n):
        value = [value]
    return value


def _circular() -> dict:
    value: dict = {"a": []}
    value["a"].append(value)
    return value


# A bad JSON value placed at items[3].n, and what the refusal says besides the path.
BAD_JSON = {
    "nul-string": ("a\x00b", "NUL"),
    "surrogate-string": ("a\udfffb", "unpaired surrogate"),
    "huge-int": (10**5000 - 1, "digits"),
    "nan": (float("nan"), "finite"),
    "set": ({1, 2}, "set"),
    "deep": (_deep(10_000), "levels deep"),
    "circular": (_circular(), "cycle"),
    "nul-key": ({"k\x00": 1}, "NUL"),
}


@pytest.fixture
def world():
    """One of everything the entry points act on, made through the ledger's API."""
    # A superuser holds every permission and tenant (no password: hashing one is slow).
    admin = User.objects.create(username="gate-admin", is_superuser=True, is_staff=True)
    run = runs.start("gate test", run_id="run-gate")
    runs.add_step(run, "s1")
    op = receipts.record_intent("articles.create", "svc://articles", {"title": "x"},
                                idempotency_key="k-gate", run=run, step="s1")
    obligations.open(run, "refund", "ob-gate")
    token = leases.acquire("res-gate", "owner-gate", timedelta(minutes=1))
    return {"admin": admin, "run": run, "op": op, "token": token}


def _counts() -> dict[str, int]:
    tables = [m._meta.db_table for m in apps.get_app_config("ledger").get_models()
              if not m._meta.proxy]
    with connection.cursor() as cursor:
        cursor.execute("SELECT " + ", ".join(f"(SELECT count(*) FROM {t})" for t in tables))
        return dict(zip(tables, cursor.fetchone(), strict=True))


def _refused(call, *names: str) -> str:
    before = _counts()
    with pytest.raises(InvalidInput) as refused:
        call()
    message = str(refused.value)
    assert message.startswith("expected"), message
    for name in names:
        assert name in message, f"expected {name!r} named in {message!r}"
    # Nothing written, and the connection (and the test's transaction) still usable.
    assert _counts() == before
    return message


# (argument named in the refusal, call with the bad value `v`, given the world `w`)
IDENTIFIER_ENTRY_POINTS = {
    "record_intent.operation": ("operation", lambda w, v: receipts.record_intent(
        v, "svc://a", {"x": 1})),
    "record_intent.target": ("target", lambda w, v: receipts.record_intent(
        "articles.create", v, {"x": 1})),
    "record_intent.tenant": ("tenant", lambda w, v: receipts.record_intent(
        "articles.create", "svc://a", {"x": 1}, tenant=v)),
    "record_intent.idempotency_key": ("idempotency_key", lambda w, v: receipts.record_intent(
        "articles.create", "svc://a", {"x": 1}, idempotency_key=v)),
    "record_intent.actor": ("actor", lambda w, v: receipts.record_intent(
        "articles.create", "svc://a", {"x": 1}, idempotency_key="k2", actor=v)),
    "record_intent.run": ("run", lambda w, v: receipts.record_intent(
        "articles.create", "svc://a", {"x": 1}, idempotency_key="k2", run=v)),
    "record_intent.step": ("step", lambda w, v: receipts.record_intent(
        "articles.create", "svc://a", {"x": 1}, idempotency_key="k2", run="run-gate",
        step=v)),
    "idempotency_key.run_id": ("run_id", lambda w, v: receipts.idempotency_key(v, "s1")),
    "idempotency_key.step_id": ("step_id", lambda w, v: receipts.idempotency_key("r", v)),
    "mark_submitted.actor": ("actor", lambda w, v: receipts.mark_submitted(w["op"], actor=v)),
    "mark_succeeded.external_id": ("external_id", lambda w, v: receipts.mark_succeeded(
        w["op"], external_id=v)),
    "mark_rejected.error_code": ("error_code", lambda w, v: receipts.mark_rejected(
        w["op"], error_code=v)),
    "mark_outcome_unknown.error_code": ("error_code", lambda w, v:
                                        receipts.mark_outcome_unknown(w["op"], error_code=v)),
    "assert_fact.subject": ("subject", lambda w, v: facts.assert_fact(
        v, "status", 1, source="crm")),
    "assert_fact.predicate": ("predicate", lambda w, v: facts.assert_fact(
        "order:1", v, 1, source="crm")),
    "assert_fact.source": ("source", lambda w, v: facts.assert_fact(
        "order:1", "status", 1, source=v)),
    "assert_fact.tenant": ("tenant", lambda w, v: facts.assert_fact(
        "order:1", "status", 1, source="crm", tenant=v)),
    "assert_fact.run": ("run", lambda w, v: facts.assert_fact(
        "order:1", "status", 1, source="crm", run=v)),
    "read_facts.subject": ("subject", lambda w, v: facts.read_facts(v)),
    "read_facts.tenant": ("tenant", lambda w, v: facts.read_facts("order:1", tenant=v)),
    "read_fact.predicate": ("predicate", lambda w, v: facts.read_fact("order:1", v)),
    "history.subject": ("subject", lambda w, v: facts.history(v, "status")),
    "open_conflicts.tenants": ("tenants", lambda w, v: list(facts.open_conflicts(tenants=[v]))),
    "obligations.open.run": ("run", lambda w, v: obligations.open(v, "refund", "ob-2")),
    "obligations.open.kind": ("kind", lambda w, v: obligations.open(w["run"], v, "ob-2")),
    "obligations.open.key": ("key", lambda w, v: obligations.open(w["run"], "refund", v)),
    "obligations.commit.key": ("key", lambda w, v: obligations.commit(v, {"ok": True})),
    "obligations.cancel.key": ("key", lambda w, v: obligations.cancel(v, reason="no")),
    "obligations.overdue.tenants": ("tenants", lambda w, v: list(
        obligations.overdue(tenants=[v]))),
    "runs.start.tenant": ("tenant", lambda w, v: runs.start("o", tenant=v)),
    "runs.start.run_id": ("run_id", lambda w, v: runs.start("o", run_id=v)),
    "runs.add_step.run": ("run", lambda w, v: runs.add_step(v, "s2")),
    "runs.add_step.step_id": ("step_id", lambda w, v: runs.add_step(w["run"], v)),
    "runs.add_step.depends_on": ("depends_on", lambda w, v: runs.add_step(
        w["run"], "s2", depends_on=[v])),
    "runs.start_step.step_id": ("step_id", lambda w, v: runs.start_step(w["run"], v)),
    "runs.commit_step.run": ("run", lambda w, v: runs.commit_step(v, "s1")),
    "runs.resume.worker": ("worker", lambda w, v: runs.resume(w["run"], worker=v)),
    "runs.hand_off.run": ("run", lambda w, v: runs.hand_off(v)),
    "episodes.record.run": ("run", lambda w, v: episodes.record(v, "user", content="hi")),
    "episodes.record.role": ("role", lambda w, v: episodes.record(w["run"], v, content="hi")),
    "leases.acquire.resource": ("resource", lambda w, v: leases.acquire(
        v, "o", timedelta(seconds=5))),
    "leases.acquire.owner": ("owner", lambda w, v: leases.acquire(
        "res-2", v, timedelta(seconds=5))),
    "leases.renew.owner": ("owner", lambda w, v: leases.renew(
        "res-gate", v, w["token"], timedelta(seconds=5))),
    "leases.release.resource": ("resource", lambda w, v: leases.release(
        v, "owner-gate", w["token"])),
    "leases.check.resource": ("resource", lambda w, v: leases.check(v, w["token"])),
    "leases.current_token.resource": ("resource", lambda w, v: leases.current_token(v)),
    "retention.set_policy.pattern": ("pattern", lambda w, v: retention.set_policy(
        v, purge_after_days=30, user=w["admin"])),
    "retention.set_policy.tenant": ("tenant", lambda w, v: retention.set_policy(
        "mail.*", tenant=v, purge_after_days=30, user=w["admin"])),
    "retention.purge.actor": ("actor", lambda w, v: retention.purge(actor=v, dry_run=True)),
    "access.grant.tenant": ("tenant", lambda w, v: access.grant(w["admin"], v)),
    "access.revoke.tenant": ("tenant", lambda w, v: access.revoke(w["admin"], v)),
    "agent_keys.create.name": ("agent name", lambda w, v: agent_keys.create(
        v, tenants=["default"], user=w["admin"])),
    "agent_keys.create.tenants": ("tenants", lambda w, v: agent_keys.create(
        "bot", tenants=[v], user=w["admin"])),
    "agent_keys.revoke.name": ("agent name", lambda w, v: agent_keys.revoke(
        v, user=w["admin"])),
    "action.operation": ("operation", lambda w, v: agent_kit.action(v, target="svc://a")),
    "action.target": ("target", lambda w, v: agent_kit.action("mail.send", target=v)),
    "action.tenant": ("tenant", lambda w, v: agent_kit.action(
        "mail.send", target="svc://a", tenant=v)),
    "retries_due.tenant": ("tenant", lambda w, v: list(agent_kit.retries_due(tenant=v))),
    "retries_due.operation": ("operation", lambda w, v: list(
        agent_kit.retries_due(operation=v))),
    "reconcile.run_once.worker": ("worker", lambda w, v: reconcile.run_once(worker=v)),
    "reconcile.claim_next.worker": ("worker", lambda w, v: reconcile.claim_next(worker=v)),
    "reconcile.register": ("operation", lambda w, v: reconcile.register(v)),
}


@pytest.mark.parametrize("bad", BAD_NAMES.values(), ids=BAD_NAMES.keys())
@pytest.mark.parametrize("entry", IDENTIFIER_ENTRY_POINTS.values(),
                         ids=IDENTIFIER_ENTRY_POINTS.keys())
def test_a_malformed_name_is_refused_naming_its_argument_and_writes_nothing(world, entry, bad):
    name, call = entry
    _refused(lambda: call(world, bad), name)


JSON_ENTRY_POINTS = {
    "record_intent.intent": ("intent", lambda w, v: receipts.record_intent(
        "articles.create", "svc://a", v, idempotency_key="k-json")),
    "mark_succeeded.evidence": ("evidence", lambda w, v: receipts.mark_succeeded(
        w["op"], evidence=v)),
    "assert_fact.value": ("value", lambda w, v: facts.assert_fact(
        "order:1", "status", v, source="crm")),
    "obligations.commit.result": ("result", lambda w, v: obligations.commit("ob-gate", v)),
}


@pytest.mark.parametrize("bad", BAD_JSON.values(), ids=BAD_JSON.keys())
@pytest.mark.parametrize("entry", JSON_ENTRY_POINTS.values(), ids=JSON_ENTRY_POINTS.keys())
def test_bad_json_is_refused_naming_its_path_and_writes_nothing(world, entry, bad):
    name, call = entry
    value, says = bad
    message = _refused(lambda: call(world, {"items": [0, 1, 2, {"n": value}]}), name, says)
    assert f"{name}.items[3].n" in message


# (argument named, call with a value of the wrong type or range)
WRONG_TYPES = {
    "add_step.depends_on=None": ("depends_on", lambda w: runs.add_step(
        w["run"], "s2", depends_on=None)),
    "add_step.depends_on=5": ("depends_on", lambda w: runs.add_step(
        w["run"], "s2", depends_on=5)),
    "add_step.depends_on=str": ("depends_on", lambda w: runs.add_step(
        w["run"], "s2", depends_on="s1")),
    "record_intent.tenant=None": ("tenant", lambda w: receipts.record_intent(
        "articles.create", "svc://a", {"x": 1}, tenant=None)),
    "record_intent.redact=None": ("redact", lambda w: receipts.record_intent(
        "articles.create", "svc://a", {"x": 1}, redact=None)),
    "record_intent.intent=list": ("intent", lambda w: receipts.record_intent(
        "articles.create", "svc://a", [1, 2])),
    "mark_succeeded.fencing_token=str": ("fencing_token", lambda w: receipts.mark_succeeded(
        w["op"], fencing_token="1")),
    "mark_submitted.expected_version=huge": ("expected_version", lambda w:
                                             receipts.mark_submitted(
                                                 w["op"], expected_version=10**5000 - 1)),
    "commit_step.fencing_token=huge": ("fencing_token", lambda w: runs.commit_step(
        w["run"], "s1", fencing_token=10**5000 - 1)),
    "leases.check.token=huge": ("fencing_token", lambda w: leases.check(
        "res-gate", 10**30)),
    "leases.release.token=None": ("fencing_token", lambda w: leases.release(
        "res-gate", "owner-gate", None)),
    "obligations.open.fencing_token=True": ("fencing_token", lambda w: obligations.open(
        w["run"], "refund", "ob-3", fencing_token=True)),
    "assert_fact.subject=7": ("subject", lambda w: facts.assert_fact(
        7, "status", 1, source="crm")),
    "mark_rejected.detail=bytes": ("detail", lambda w: receipts.mark_rejected(
        w["op"], error_code="E", detail=b"x")),
    "retention.set_policy.pattern=newline": ("pattern", lambda w: retention.set_policy(
        "mail.*\n", purge_after_days=30, user=w["admin"])),
    "retention.set_policy.tenant=None": ("tenant", lambda w: retention.set_policy(
        "mail.*", tenant=None, purge_after_days=30, user=w["admin"])),
    "action.redact=None": ("redact", lambda w: agent_kit.action(
        "mail.send", target="svc://a", redact=None)),
}


@pytest.mark.parametrize("entry", WRONG_TYPES.values(), ids=WRONG_TYPES.keys())
def test_a_value_of_the_wrong_type_is_refused_naming_its_argument(world, entry):
    name, call = entry
    _refused(lambda: call(world), name)


# --- the gate's own pieces ------------------------------------------------------------------


def test_names_are_matched_whole_not_up_to_a_trailing_newline():
    for bad in ("articles.create\n", "articles.create\r\n", "a\u2028b"):
        with pytest.raises(InvalidInput, match="operation"):
            inputs.check_operation_name(bad)
    with pytest.raises(InvalidInput, match="pattern"):
        inputs.check_operation_pattern("mail.*\n")
    assert inputs.check_operation_name("crm/contacts.update") == "crm/contacts.update"


def test_json_is_walked_without_recursion_to_the_configured_depth(settings):
    settings.LEDGER_MAX_JSON_DEPTH = 3
    assert inputs.check_json({"a": {"b": [1]}}) == {"a": {"b": [1]}}
    with pytest.raises(InvalidInput, match=r"nested at most 3 levels deep.*intent\.a\.b\[0\]"):
        inputs.check_json({"a": {"b": [[1]]}})
    settings.LEDGER_MAX_JSON_DEPTH = 1_000_000
    # Deeper than Python's recursion limit, and refused only by the integer inside.
    with pytest.raises(InvalidInput, match="digits"):
        inputs.check_json(_deep(50_000) + [int("1" * 200)])


def test_a_shared_branch_is_not_a_cycle():
    shared = {"x": 1}
    assert inputs.check_json({"a": shared, "b": [shared, shared]})


def test_keys_that_are_not_plain_words_are_named_quoted_in_the_path():
    with pytest.raises(InvalidInput) as refused:
        inputs.check_json({"a b": {"c": "\x00"}})
    assert "intent['a b'].c" in str(refused.value)


def test_outside_text_is_made_storable_and_cut_with_a_marker():
    assert inputs.storable_text("reset\x00 by \ud800peer", "detail") == \
        "reset\ufffd by \ufffdpeer"
    cut = inputs.storable_text("x" * 10_000, "detail", 100)
    assert len(cut) == 100 and cut.endswith("more characters]") and cut.startswith("xxx")
    assert "9,9" in cut  # how much was cut
    with pytest.raises(InvalidInput, match="expected detail to be a string, found int"):
        inputs.storable_text(5, "detail")


def test_a_refusal_never_carries_the_bad_characters_themselves():
    with pytest.raises(InvalidInput) as refused:
        inputs.check_identifier("a\x00\ud800", "tenant")
    message = str(refused.value)
    assert "\x00" not in message and "\ud800" not in message
    message.encode("utf-8")  # storable and printable as it is


def test_free_text_with_nul_and_surrogates_is_recorded_not_refused(world):
    op = world["op"]
    receipts.mark_submitted(op)
    op = receipts.mark_outcome_unknown(op, error_code="ConnectionReset",
                                       detail="reset\x00 by \ud800peer")
    op.refresh_from_db()
    assert op.error_detail == "reset\ufffd by \ufffdpeer"
    event = op.events.order_by("-version").first()
    assert "\ufffd" in event.reason
    obligations.cancel("ob-gate", reason="not\x00needed")
    run = runs.start("objective with a \x00", run_id="run-prose")
    assert run.objective == "objective with a \ufffd"
    episode = episodes.record(run, "tool", content="output \udc80 here")
    assert episode.content == "output \ufffd here"
