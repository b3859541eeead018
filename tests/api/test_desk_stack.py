"""The API under the desk's whole middleware stack (WSGI, `runserver`, Django's test
client): the login-required middleware lets it through, CSRF does not apply, and a session
does not authenticate it."""

from __future__ import annotations

import pytest

from ledger import agent_keys
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


def test_no_redirect_to_the_login_page_and_no_csrf_refusal(client):
    for response in (client.get("/api/v1/operations"),
                     client.post("/api/v1/operations", {}, content_type="application/json"),
                     client.post("/api/v1/no-such-route", {}, content_type="application/json")):
        assert response.status_code in (401, 404), response.content
        assert response["Content-Type"] == "application/problem+json"
    assert client.get("/api/v1/docs").status_code == 200
    assert client.get("/api/v1/openapi.json").status_code == 200


def test_a_key_works_and_a_session_alone_does_not(client, admin_user):
    _, secret = agent_keys.create("desk-stack-bot", tenants=["default"], user=admin_user)
    csrf_client = client.__class__(enforce_csrf_checks=True)
    created = csrf_client.post(
        "/api/v1/operations",
        {"operation": "mail.send", "target": "smtp://x", "intent": {"to": "a"}},
        content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {secret}")
    assert created.status_code == 201

    csrf_client.force_login(UserFactory(username="viewer", role="viewer"))
    assert csrf_client.get("/").status_code == 200
    assert csrf_client.get("/api/v1/operations").status_code == 401
