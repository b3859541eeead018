"""`ledger` and `review` as reusable apps: installed in another project, they work alone.

The main test runs a child process whose settings (tests/support/minimal_settings.py) know
nothing of config/ or demo/: it migrates a database of its own on the same PostgreSQL
server, takes a receipt from intent to a reviewer's decision, and renders the desk.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psycopg
import pytest
from django.contrib.contenttypes.models import ContentType
from django.db import connection
from django.urls import reverse
from psycopg import sql

from ledger.models import Operation
from review.templatetags.desk import operation_url
from tests.factories import OperationFactory
from tests.support.processes import ROOT

CHILD = """
import json, sys
import django

django.setup()

from django.contrib.auth.models import Group, User
from django.contrib.staticfiles import finders
from django.core.management import call_command
from django.test import Client

call_command("check")
call_command("migrate", interactive=False, verbosity=0)

from ledger import access, conf, receipts
from ledger.models import Operation, OperationEvent

reviewer = User.objects.create_user("reviewer", password="correct horse battery staple")
reviewer.groups.add(Group.objects.get(name="reviewer"))
access.grant(reviewer, "default")

op = receipts.record_intent(
    "articles.create", "https://cms.example/api/articles",
    {"title": "Quarterly report", "headers": {"Authorization": "Bearer sk-live-123"}},
)
receipts.mark_submitted(op)
receipts.mark_outcome_unknown(op, error_code="TimeoutError", detail="read timed out")

anonymous = Client().get("/desk/")
login_page = Client().get("/accounts/login/")
client = Client()
client.force_login(reviewer)
queue = client.get("/desk/")
decision = client.post(
    f"/desk/operations/{op.operation_id}/resolve/",
    {"to_state": "succeeded", "reason": "seen in the CMS", "version": op.version},
)
detail = client.get(decision["Location"])
healthz = Client().get("/healthz")
metrics = Client().get("/metrics")
csrf_client = Client(enforce_csrf_checks=True)
csrf_client.force_login(reviewer)
csrf = csrf_client.post(f"/desk/operations/{op.operation_id}/resolve/",
                        {"to_state": "abandoned", "reason": "no token", "version": 1})
op.refresh_from_db()
event = OperationEvent.objects.filter(operation=op).order_by("-version").first()

print("RESULT " + json.dumps({
    "operation_id": op.operation_id,
    "state": op.state,
    "intent_headers": op.intent["headers"],
    "event": [event.from_state, event.to_state, event.actor_kind, event.actor_id, event.reason],
    "anonymous": [anonymous.status_code, anonymous.get("Location", "")],
    "login": [login_page.status_code, login_page.content.decode()],
    "queue": [queue.status_code, queue.content.decode()],
    "decision": [decision.status_code, decision.get("Location", "")],
    "detail": [detail.status_code, detail.content.decode()],
    "healthz": [healthz.status_code, healthz.json()],
    "metrics": [metrics.status_code, metrics["Content-Type"], metrics.json()],
    "csrf": [csrf.status_code, csrf.content.decode()],
    "settings": {name: getattr(conf, name) for name in conf.SETTINGS},
    "stylesheet_found": finders.find("desk/desk.css") is not None,
    "has_absolute_url": hasattr(Operation, "get_absolute_url"),
    "project_modules": sorted(
        m for m in sys.modules if m.split(".")[0] in ("config", "demo")
    ),
}))
"""


@pytest.fixture
def host_database():
    """A database of its own on the test server, dropped afterwards; its connection JSON."""
    params = {key: connection.settings_dict[key] for key in ("HOST", "PORT", "USER", "PASSWORD")}
    name = connection.settings_dict["NAME"].removeprefix("test_") + "_minimal_host"
    server = psycopg.connect(host=params["HOST"] or None, port=params["PORT"] or None,
                             user=params["USER"] or None, password=params["PASSWORD"] or None,
                             dbname="postgres", autocommit=True)
    drop = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
    with server:
        server.execute(drop)
        server.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        try:
            yield json.dumps({**params, "NAME": name})
        finally:
            server.execute(drop)


def test_ledger_and_review_run_a_lifecycle_and_the_desk_in_a_project_without_config(
    host_database,
):
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("LEDGER_", "DJANGO_"))}
    env.update(DJANGO_SETTINGS_MODULE="tests.support.minimal_settings",
               MINIMAL_HOST_DATABASE=host_database, PYTHONPATH=str(ROOT))
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
    lines = [line for line in child.stdout.splitlines() if line.startswith("RESULT ")]
    assert child.returncode == 0 and lines, (
        f"expected the child to print its RESULT line and exit 0, found exit "
        f"{child.returncode}; stderr:\n{child.stderr[-4000:]}"
    )
    result = json.loads(lines[0].removeprefix("RESULT "))
    op_page = f"/desk/operations/{result['operation_id']}/"

    assert result["project_modules"] == []
    assert result["settings"] == {"MAX_INTENT_BYTES": 262144, "MAX_JSON_DEPTH": 64,
                                  "RECONCILE_MAX_FAILURES": 3,
                                  "STALE_SUBMISSION_SECONDS": 600, "IN_FLIGHT_SECONDS": 60,
                                  "RECONCILER_MODULES": [],
                                  "DESK_URL": "http://127.0.0.1:8000", "WEBHOOK_SECRETS": {},
                                  "AUDIT_SIGNING_KEY": "", "UNKNOWN_OUTCOME_POLICIES": {},
                                  "OPERATION_RULES": {},
                                  "WEBHOOK_ALLOW_PRIVATE": False,
                                  "NOTIFY_ITEMS_PER_MESSAGE": 20, "NOTIFY_MAX_ATTEMPTS": 8,
                                  "NOTIFY_BACKOFF_SECONDS": 30,
                                  "NOTIFY_BACKOFF_CAP_SECONDS": 3600,
                                  "NOTIFY_TIMEOUT_SECONDS": 10,
                                  "NOTIFY_QUEUE_GRACE_SECONDS": 60,
                                  "HEALTH_RECONCILE_BACKLOG_SECONDS": 300,
                                  "HEALTH_SEAL_LAG_SECONDS": 30, "METRICS_TOKEN": "",
                                  "TRUSTED_PROXY_COUNT": 0, "FACT_MAX_FUTURE_SECONDS": 300,
                                  "TRACE_URL": "", "MAX_REQUEST_BYTES": 1048576,
                                  "AGENT_KEY_CACHE_SECONDS": 0}
    assert result["has_absolute_url"] is False
    assert result["stylesheet_found"] is True
    assert result["intent_headers"] == {"Authorization": "[redacted]"}
    assert result["event"] == ["outcome_unknown", "succeeded", "human", "reviewer",
                               "seen in the CMS"]
    assert result["state"] == "succeeded"

    assert result["anonymous"] == [302, "/accounts/login/?next=/desk/"]
    login_status, login_body = result["login"]
    assert login_status == 200 and "Log in to the review desk" in login_body

    queue_status, queue_body = result["queue"]
    assert queue_status == 200
    assert f'<a href="{op_page}">{result["operation_id"]}</a>' in queue_body
    assert 'href="/static/desk/desk.css"' in queue_body
    assert 'href="/desk/">Queue</a>' in queue_body.replace(' aria-current="page"', "")
    assert "Admin</a>" not in queue_body and "sk-live-123" not in queue_body

    assert result["decision"] == [302, op_page]
    detail_status, detail_body = result["detail"]
    assert detail_status == 200 and "Recorded: " in detail_body

    # The operators' endpoints read their settings' defaults (ledger/conf.py): /healthz
    # runs every check; /metrics is off while no token is set.
    healthz_status, healthz_body = result["healthz"]
    assert healthz_status == 200 and healthz_body["status"] in ("ok", "warn")
    assert {"database", "migrations", "reconcile_backlog", "sealer_lag"} <= set(
        healthz_body["checks"])
    assert healthz_body["checks"]["database"]["ok"] is True
    metrics_status, metrics_type, metrics_body = result["metrics"]
    assert (metrics_status, metrics_type) == (404, "application/problem+json")
    assert "LEDGER_METRICS_TOKEN" in metrics_body["detail"]
    # A POST without its CSRF token gets the desk's own page, from inside `review`.
    csrf_status, csrf_body = result["csrf"]
    assert csrf_status == 403 and "This form could not be accepted" in csrf_body
    assert 'href="/static/desk/desk.css"' in csrf_body


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize(("app", "forbidden"), [
    ("ledger", ("review", "demo", "config", "tests")),
    ("review", ("demo", "config", "tests")),
])
def test_a_reusable_app_imports_nothing_of_the_project(app, forbidden):
    found = sorted(
        f"{path.relative_to(ROOT)} imports {module}"
        for path in (ROOT / app).rglob("*.py")
        for module in _imported_modules(path)
        if module.split(".")[0] in forbidden
    )
    assert found == [], f"expected {app}/ to import none of {forbidden}, found {found}"


@pytest.mark.django_db
def test_the_admin_view_on_site_link_of_an_operation_opens_its_desk_page(client,
                                                                         django_user_model):
    op = OperationFactory(state="outcome_unknown")
    client.force_login(django_user_model.objects.create_superuser("root", password="x" * 20))
    link = reverse("admin:view_on_site",
                   args=[ContentType.objects.get_for_model(Operation).pk, op.pk])
    assert f'href="{link}"' in client.get(
        reverse("admin:ledger_operation_change", args=[op.pk])).content.decode()
    response = client.get(link)
    assert (response.status_code, response["Location"]) == (
        302, f"http://testserver{operation_url(op)}")
