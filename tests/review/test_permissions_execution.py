"""The permission matrix of the execution-state pages: anonymous, no role, viewer,
reviewer, admin and a user of another tenant, on every new URL."""

import pytest
from django.urls import reverse

from ledger import runs
from ledger.models import FactConflict
from tests.review.execution_setup import make_conflict, make_overdue
from tests.review.test_permissions import ROLES, login_as

PAGES = ["conflicts", "conflict", "overdue", "run"]
SEES_ALL = dict.fromkeys(PAGES, 200)
EXPECTED_GET = {
    "anonymous": dict.fromkeys(PAGES, 302),
    "no role": dict.fromkeys(PAGES, 403),
    "viewer": SEES_ALL,
    "reviewer": SEES_ALL,
    "admin": SEES_ALL,
    # Lists answer (with nothing of tenant "default" on them); single objects are 404.
    "other tenant": {"conflicts": 200, "conflict": 404, "overdue": 200, "run": 404},
}
# "Use this value": the status, and whether the conflict is left open.
EXPECTED_POST = {
    "anonymous": (302, True),
    "no role": (403, True),
    "viewer": (403, True),
    "reviewer": (302, False),
    "admin": (302, False),
    "other tenant": (404, True),
}


@pytest.fixture
def records(db):
    run = runs.start("Matrix run", run_id="run-matrix")
    make_overdue(run, key="matrix:overdue")
    return {"run": run, "conflict": make_conflict(run=run)}


def page_url(page, records):
    if page == "conflict":
        return reverse("review:conflict", args=[records["conflict"].pk])
    if page == "run":
        return reverse("review:run", args=[records["run"].run_id])
    return reverse(f"review:{page}")


@pytest.mark.django_db
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("page", PAGES)
def test_execution_pages_answer_each_role_as_the_matrix_says(client, records, role, page):
    login_as(client, role)
    response = client.get(page_url(page, records))
    assert response.status_code == EXPECTED_GET[role][page]
    if response.status_code == 302:
        assert response["Location"].startswith("/accounts/login/")
    if role == "other tenant" and page in ("conflicts", "overdue"):
        body = response.content.decode()
        assert "invoice:42" not in body and "matrix:overdue" not in body


@pytest.mark.django_db
@pytest.mark.parametrize("role", ROLES)
def test_use_this_value_answers_each_role_as_the_matrix_says(client, records, role):
    conflict = records["conflict"]
    login_as(client, role)
    response = client.post(reverse("review:resolve_conflict", args=[conflict.pk]),
                           {"winner": "candidate", "reason": "matrix", "expected_version": 1})
    status, stays_open = EXPECTED_POST[role]
    assert response.status_code == status
    assert FactConflict.objects.get(pk=conflict.pk).is_open is stays_open


@pytest.mark.django_db
def test_get_on_use_this_value_changes_nothing(client, records, reviewer):
    conflict = records["conflict"]
    client.force_login(reviewer)
    url = reverse("review:resolve_conflict", args=[conflict.pk])
    assert client.get(url, {"winner": "candidate", "reason": "x",
                            "expected_version": 1}).status_code == 405
    assert FactConflict.objects.get(pk=conflict.pk).is_open


@pytest.mark.django_db
def test_the_other_tenant_sees_its_own_execution_state(client):
    run = runs.start("Acme run", tenant="acme", run_id="run-acme")
    make_overdue(run, key="acme:overdue")
    conflict = make_conflict("acme:invoice", tenant="acme", run=run)
    login_as(client, "other tenant")
    assert "acme:invoice" in client.get(reverse("review:conflicts")).content.decode()
    assert "acme:overdue" in client.get(reverse("review:overdue")).content.decode()
    assert client.get(reverse("review:conflict", args=[conflict.pk])).status_code == 200
    assert client.get(reverse("review:run", args=["run-acme"])).status_code == 200
