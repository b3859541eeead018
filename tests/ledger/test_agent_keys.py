"""Agent keys: created and revoked by admins only, audited, only a hash stored."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.db import connection, transaction
from django.db.utils import ProgrammingError
from django.test.utils import CaptureQueriesContext

from ledger import access, agent_keys, receipts
from ledger.errors import InvalidInput, PermissionDenied
from ledger.models import AgentKey, AgentKeyChange
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin_user(admin_user):
    """The admin holds the tenants the keys below name (nobody hands out a tenant they
    cannot see themselves)."""
    for tenant in ("acme", "globex"):
        access.grant(admin_user, tenant)
    return admin_user


def test_a_key_names_only_tenants_its_creator_holds(admin_user):
    with pytest.raises(PermissionDenied, match="to be granted tenant 'initech'"):
        agent_keys.create("rogue-bot", tenants=["acme", "initech"], user=admin_user)
    assert not AgentKey.objects.exists()
    other = UserFactory(username="acme-only-admin", role="admin", tenants=["acme"])
    agent_keys.create("globex-bot", tenants=["globex"], user=admin_user)
    with pytest.raises(PermissionDenied, match="to be granted tenant 'globex'"):
        agent_keys.revoke("globex-bot", user=other)
    assert AgentKey.objects.get(name="globex-bot").revoked_at is None


def test_create_returns_the_secret_once_and_stores_only_its_hash(admin_user):
    key, secret = agent_keys.create("billing-bot", tenants=["default", "acme"], user=admin_user)

    assert secret.startswith("alk_") and len(secret) > 40
    assert key.prefix == secret[:8]
    with connection.cursor() as cursor:
        cursor.execute("SELECT * FROM ledger_agentkey")
        stored = cursor.fetchall()
        cursor.execute("SELECT * FROM ledger_agentkeychange")
        stored += cursor.fetchall()
    assert secret not in repr(stored)
    assert secret[8:] not in repr(stored)
    assert agent_keys.authenticate(secret) == key


def test_a_key_sees_exactly_its_tenants_and_holds_no_permission(admin_user):
    key, secret = agent_keys.create("billing-bot", tenants=["acme"], user=admin_user)
    key = agent_keys.authenticate(secret)

    assert access.tenants_for(key) == frozenset({"acme"})
    assert access.can_see(key, "acme") and not access.can_see(key, "default")
    assert not key.has_perm("ledger.resolve_operation")
    with pytest.raises(PermissionDenied):
        access.require_tenant(key, "default")


def test_revoked_unknown_and_malformed_secrets_authenticate_nothing(admin_user):
    _, secret = agent_keys.create("billing-bot", tenants=["default"], user=admin_user)

    agent_keys.revoke("billing-bot", user=admin_user)

    assert agent_keys.authenticate(secret) is None
    assert agent_keys.authenticate("alk_" + "a" * 43) is None
    assert agent_keys.authenticate("Bearer " + secret) is None
    assert agent_keys.authenticate(None) is None
    assert agent_keys.revoke("billing-bot", user=admin_user).revoked_by_name == "admin"
    assert AgentKeyChange.objects.filter(action="revoked").count() == 1  # revoked once


def test_the_key_and_an_operation_of_its_tenants_are_read_in_one_statement(admin_user):
    key, secret = agent_keys.create("billing-bot", tenants=["acme", "globex"], user=admin_user)
    globex_op = receipts.record_intent("mail.send", "smtp://x", {"n": 1}, tenant="globex")
    other_op = receipts.record_intent("mail.send", "smtp://x", {"n": 2}, tenant="default")

    with CaptureQueriesContext(connection) as queries:
        found_key, found = agent_keys.authenticate_with_operation(
            secret, globex_op.operation_id)

    assert len(queries) == 1
    assert found_key == key and found_key.tenants == ["acme", "globex"]
    assert found == globex_op and found.intent == {"n": 1} and found.state == "planned"
    # Another tenant's operation and a missing one: the key, and no operation.
    assert agent_keys.authenticate_with_operation(secret, other_op.operation_id) == (key, None)
    assert agent_keys.authenticate_with_operation(
        secret, "20260101T000000Z-0000000000") == (key, None)


def test_a_revoked_key_reads_no_operation_even_of_its_tenants(admin_user):
    _, secret = agent_keys.create("billing-bot", tenants=["default"], user=admin_user)
    op = receipts.record_intent("mail.send", "smtp://x", {"n": 1})
    assert agent_keys.authenticate_with_operation(secret, op.operation_id)[1] == op

    agent_keys.revoke("billing-bot", user=admin_user)

    assert agent_keys.authenticate_with_operation(secret, op.operation_id) == (None, None)
    assert agent_keys.authenticate_with_operation("alk_" + "a" * 43, op.operation_id) == \
        (None, None)
    assert agent_keys.authenticate_with_operation(None, op.operation_id) == (None, None)


def test_creation_and_revocation_are_audited_with_who_and_when(admin_user):
    agent_keys.create("billing-bot", tenants=["default"], user=admin_user)
    agent_keys.revoke("billing-bot", user=admin_user)

    changes = list(AgentKeyChange.objects.order_by("id").values_list(
        "action", "key_name", "tenants", "changed_by_name", "changed_by"))
    assert changes == [("created", "billing-bot", ["default"], "admin", admin_user.pk),
                       ("revoked", "billing-bot", ["default"], "admin", admin_user.pk)]


def test_the_audit_of_keys_is_append_only_in_postgresql(admin_user):
    agent_keys.create("billing-bot", tenants=["default"], user=admin_user)
    for statement in ("UPDATE ledger_agentkeychange SET changed_by_name = 'someone'",
                      "DELETE FROM ledger_agentkeychange"):
        with pytest.raises(ProgrammingError, match="Cannot update or delete"), \
                transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(statement)
    assert AgentKeyChange.objects.get().changed_by_name == "admin"


@pytest.mark.parametrize("role", ["viewer", "reviewer"])
def test_only_admins_create_and_revoke_keys(admin_user, role):
    user = UserFactory(username=f"a-{role}", role=role)
    with pytest.raises(PermissionDenied, match="ledger.add_agentkey"):
        agent_keys.create("billing-bot", tenants=["default"], user=user)
    agent_keys.create("billing-bot", tenants=["default"], user=admin_user)
    with pytest.raises(PermissionDenied, match="ledger.change_agentkey"):
        agent_keys.revoke("billing-bot", user=user)
    assert AgentKey.objects.get().revoked_at is None


@pytest.mark.parametrize(("name", "tenants"), [
    ("", ["default"]), ("has space", ["default"]), ("x" * 101, ["default"]),
    ("bot", []), ("bot", "default"), ("bot", ["a", "a"]), ("bot", [""]),
])
def test_malformed_names_and_tenants_are_refused(admin_user, name, tenants):
    with pytest.raises(InvalidInput, match="expected"):
        agent_keys.create(name, tenants=tenants, user=admin_user)
    assert not AgentKey.objects.exists()


def test_a_name_names_one_agent_even_after_revocation(admin_user):
    agent_keys.create("billing-bot", tenants=["default"], user=admin_user)
    agent_keys.revoke("billing-bot", user=admin_user)
    with pytest.raises(InvalidInput, match="found a key named 'billing-bot' already"):
        agent_keys.create("billing-bot", tenants=["default"], user=admin_user)


def test_the_command_creates_lists_and_revokes(capsys):
    call_command("agent_key", "create", "cli-bot", "--tenant", "acme", "--tenant", "globex")
    out, err = capsys.readouterr()
    secret = out.strip()
    key = agent_keys.authenticate(secret)
    assert key.name == "cli-bot" and key.tenants == ["acme", "globex"]
    assert "shown only now" in err
    assert AgentKeyChange.objects.get().changed_by_name.startswith("manage.py agent_key (")

    call_command("agent_key", "list")
    listed = capsys.readouterr().out
    assert "cli-bot" in listed and secret not in listed and key.prefix in listed

    call_command("agent_key", "revoke", "cli-bot")
    assert agent_keys.authenticate(secret) is None


def test_admin_pages_create_show_the_secret_once_list_and_revoke(client, admin_user):
    admin_user.is_staff = True
    admin_user.save()
    client.force_login(admin_user)

    page = client.post("/admin/ledger/agentkey/add/", {"name": "desk-bot",
                                                       "tenants": "default, acme"})
    assert page.status_code == 200 and "no-store" in page["Cache-Control"]
    secret = page.context["secret"]
    assert secret in page.content.decode()
    key = agent_keys.authenticate(secret)
    assert key.tenants == ["default", "acme"]

    listing = client.get("/admin/ledger/agentkey/")
    assert "desk-bot" in listing.content.decode()
    assert secret not in listing.content.decode()
    assert key.secret_hash not in listing.content.decode()
    detail = client.get(f"/admin/ledger/agentkey/{key.pk}/change/").content.decode()
    assert key.secret_hash not in detail and secret not in detail

    client.post("/admin/ledger/agentkey/", {"action": "revoke_keys",
                                            "_selected_action": [key.pk]})
    assert agent_keys.authenticate(secret) is None
    assert AgentKeyChange.objects.filter(action="revoked", changed_by=admin_user).exists()


def test_admin_add_page_shows_the_ledgers_refusal(client, admin_user):
    admin_user.is_staff = True
    admin_user.save()
    client.force_login(admin_user)
    page = client.post("/admin/ledger/agentkey/add/", {"name": "bad name", "tenants": "x"})
    assert "expected an agent name" in page.content.decode()
    assert not AgentKey.objects.exists()


def test_verified_keys_keep_no_secret_and_return_a_fresh_key_each_time(admin_user):
    key, secret = agent_keys.create("cache-bot", tenants=["acme"], user=admin_user)

    first = agent_keys.authenticate(secret)
    again = agent_keys.authenticate(secret)

    assert first.pk == again.pk == key.pk and first is not again
    assert again.tenants == ["acme"] and again.name == "cache-bot"
    entries = repr(agent_keys._verified._entries)
    assert secret not in entries and secret[len(agent_keys.SECRET_PREFIX):] not in entries


def test_verified_keys_are_bounded_in_number_the_least_recently_used_dropped(settings):
    settings.LEDGER_AGENT_KEY_CACHE_SECONDS = 60
    verified = agent_keys.VerifiedKeys(size=2)
    keys = {name: AgentKey(pk=i + 1, name=name, prefix="alk_x", secret_hash=name * 64,
                           tenants=["acme"]) for i, name in enumerate("abc")}
    verified.put("a", keys["a"])
    verified.put("b", keys["b"])
    assert verified.get("a").name == "a"  # a used last: b goes first
    verified.put("c", keys["c"])

    assert verified.get("b") is None
    assert verified.get("a").name == "a" and verified.get("c").name == "c"
    verified.forget(3)
    assert verified.get("c") is None


def test_verified_keys_expire(settings):
    settings.LEDGER_AGENT_KEY_CACHE_SECONDS = 5
    now = [1000.0]
    verified = agent_keys.VerifiedKeys(clock=lambda: now[0])
    verified.put("a", AgentKey(pk=1, name="a", prefix="alk_x", secret_hash="a" * 64,
                               tenants=["acme"]))

    now[0] += 4.9
    assert verified.get("a") is not None
    now[0] += 0.2
    assert verified.get("a") is None
