"""A repeat of a submitting request (the same Request-Id) gets the same answer when the
API's database login is the agent role: from a real child process logged in as
ledger_agent's login, only the same key and the same id at the same version are answered
`submitted_now` again; another id, no id, or another key holding the id are in flight."""

from __future__ import annotations

import pytest

from ledger import agent_keys
from ledger.models import Operation
from tests.conftest import TEST_LOGINS
from tests.factories import UserFactory
from tests.support.processes import run_as

pytestmark = pytest.mark.django_db(transaction=True)

REPEATS = """
from django.db import connection
from api import service
from ledger.errors import InFlight
from ledger.models import AgentKey

result = {}
with connection.cursor() as cursor:
    cursor.execute("SELECT current_user")
    result["login"] = cursor.fetchone()[0]
mine, theirs = (AgentKey.objects.get(name=n) for n in ("doc-bot", "other-bot"))
ask = dict(operation="mail.send", target="smtp://m", intent={"to": "a"},
           idempotency_key="a", submit=True)

def answer(key, request_id):
    try:
        data, _ = service.record_intent(key, **ask, request_id=request_id)
        return [data["submitted_now"], data["request_repeated"], data["version"]]
    except InFlight as exc:
        return ["in flight", type(exc).__name__]

rid = "req-0123456789abcdef-agent-role"
result["first"] = answer(mine, rid)
result["repeat"] = answer(mine, rid)
result["other id"] = answer(mine, "req-another-id-0123456789")
result["no id"] = answer(mine, None)
result["other key"] = answer(theirs, rid)
"""


def test_only_the_same_key_and_request_id_get_the_submission_again_as_the_agent_role():
    user = UserFactory(username="keys-admin", role="admin", tenants=[])
    user.is_superuser = True
    user.save(update_fields=["is_superuser"])
    agent_keys.create("doc-bot", tenants=["default"], user=user)
    agent_keys.create("other-bot", tenants=["default"], user=user)
    found = run_as(TEST_LOGINS["agent"], REPEATS)
    assert found["login"] == TEST_LOGINS["agent"]
    assert found["first"] == [True, False, 2]
    assert found["repeat"] == [True, True, 2]
    for refused in ("other id", "no id", "other key"):
        assert found[refused] == ["in flight", "InFlight"], (refused, found)
    [op] = Operation.objects.all()
    assert op.state == "submitted" and op.events.filter(to_state="submitted").count() == 1
