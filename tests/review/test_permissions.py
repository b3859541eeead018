"""The permission matrix: every URL for anonymous, no role, viewer, reviewer, admin and a
user of another tenant."""

import pytest
from django.urls import reverse

from ledger.models import Operation
from ledger.states import State
from tests.factories import OperationFactory, UserFactory

ROLES = ["anonymous", "no role", "viewer", "reviewer", "admin", "other tenant"]
PAGES = ["queue", "audit", "audit_csv", "operation"]

# What each role gets for each GET page.
EXPECTED_GET = {
    "anonymous": {"queue": 302, "audit": 302, "audit_csv": 302, "operation": 302},
    "no role": {"queue": 403, "audit": 403, "audit_csv": 403, "operation": 403},
    "viewer": {"queue": 200, "audit": 200, "audit_csv": 200, "operation": 200},
    "reviewer": {"queue": 200, "audit": 200, "audit_csv": 200, "operation": 200},
    "admin": {"queue": 200, "audit": 200, "audit_csv": 200, "operation": 200},
    "other tenant": {"queue": 200, "audit": 200, "audit_csv": 200, "operation": 404},
}
# The decision POST, and the state the operation is left in.
EXPECTED_POST = {
    "anonymous": (302, State.OUTCOME_UNKNOWN),
    "no role": (403, State.OUTCOME_UNKNOWN),
    "viewer": (403, State.OUTCOME_UNKNOWN),
    "reviewer": (302, State.ABANDONED),
    "admin": (302, State.ABANDONED),
    "other tenant": (404, State.OUTCOME_UNKNOWN),
}


def login_as(client, role):
    if role == "anonymous":
        return
    users = {
        "no role": lambda: UserFactory(username="nobody"),
        "viewer": lambda: UserFactory(username="viewer", role="viewer"),
        "reviewer": lambda: UserFactory(username="reviewer", role="reviewer"),
        "admin": lambda: UserFactory(username="admin", role="admin"),
        "other tenant": lambda: UserFactory(username="acme", role="admin", tenants=["acme"]),
    }
    client.force_login(users[role]())


def page_url(page, op):
    if page == "operation":
        return reverse("review:operation", args=[op.operation_id])
    return reverse(f"review:{page}")


@pytest.mark.django_db
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("page", PAGES)
def test_get_pages_answer_each_role_as_the_matrix_says(client, role, page):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    login_as(client, role)
    response = client.get(page_url(page, op))
    assert response.status_code == EXPECTED_GET[role][page]
    if response.status_code == 302:
        assert response["Location"].startswith("/accounts/login/")
    if role == "other tenant" and page == "queue":
        assert op.operation_id not in response.content.decode()


@pytest.mark.django_db
@pytest.mark.parametrize("role", ROLES)
def test_the_decision_post_answers_each_role_as_the_matrix_says(client, role):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    login_as(client, role)
    response = client.post(reverse("review:resolve", args=[op.operation_id]),
                           {"to_state": State.ABANDONED, "reason": "matrix",
                            "version": op.version})
    status, state = EXPECTED_POST[role]
    assert response.status_code == status
    assert Operation.objects.get(pk=op.pk).state == state


@pytest.mark.django_db
@pytest.mark.parametrize("page", PAGES)
def test_the_other_tenant_sees_its_own_operations(client, page):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN, tenant="acme")
    login_as(client, "other tenant")
    response = client.get(page_url(page, op))
    assert response.status_code == 200
    if page in ("queue", "operation", "audit"):
        assert op.operation_id in response.content.decode()


@pytest.mark.django_db
def test_login_page_renders_and_logout_is_a_post(client, reviewer):
    assert client.get("/accounts/login/").status_code == 200
    response = client.post("/accounts/login/", {"username": "reviewer",
                                                "password": "correct horse battery staple"})
    assert response.status_code == 302 and response["Location"] == "/"
    assert client.get("/").status_code == 200
    assert client.get("/accounts/logout/").status_code == 405
    assert client.post("/accounts/logout/").status_code == 302
    assert client.get("/").status_code == 302
