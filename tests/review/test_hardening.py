"""Web hardening of the desk: login lockout, no-store on desk pages, the CSRF failure page.

Logins go through the real login view (`/accounts/login/`) with the test client, so the
lockout is django-axes as configured in settings, not a helper called directly.
"""

from __future__ import annotations

import pytest
from django.test import Client

from ledger.states import State
from tests.factories import OperationFactory, UserFactory

PASSWORD = "correct horse battery staple"


@pytest.fixture(autouse=True)
def quick_hasher(settings):
    """Every login attempt runs the hasher; what these tests count is attempts, not hashing
    (tests/review/test_permissions.py logs in through the real hasher's full cost)."""
    settings.PASSWORD_HASHERS = ["tests.support.hashers.QuickPBKDF2PasswordHasher"]


@pytest.fixture
def alice(db):
    user = UserFactory(username="alice", role="reviewer")
    user.set_password(PASSWORD)
    user.save()
    return user


def login(client: Client, username: str, password: str, **extra):
    return client.post("/accounts/login/", {"username": username, "password": password},
                       **extra)


def is_logged_in(client: Client) -> bool:
    return "_auth_user_id" in client.session


@pytest.mark.django_db
def test_twenty_wrong_passwords_then_the_right_one_does_not_log_in(client, alice):
    for _ in range(20):
        response = login(client, "alice", "wrong")
        assert not is_logged_in(client)
    response = login(client, "alice", PASSWORD)
    assert response.status_code == 429
    assert not is_logged_in(client)
    page = response.content.decode()
    assert "Login locked" in page and "even with the right password" in page
    assert "15 minutes" in page and "alice" in page
    assert client.get("/").status_code == 302  # still sent to the login page


@pytest.mark.django_db
def test_the_lockout_starts_at_the_configured_limit(client, alice, settings):
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        assert login(client, "alice", "wrong").status_code == 200
    assert login(client, "alice", "wrong").status_code == 429
    assert login(client, "alice", PASSWORD).status_code == 429


@pytest.mark.django_db
def test_a_success_below_the_limit_logs_in_and_resets_the_count(client, alice, settings):
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        login(client, "alice", "wrong")
    response = login(client, "alice", PASSWORD)
    assert response.status_code == 302 and is_logged_in(client)
    client.logout()
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        login(client, "alice", "wrong")
    assert login(client, "alice", PASSWORD).status_code == 302


@pytest.mark.django_db
def test_wrong_passwords_from_rotating_addresses_still_lock_the_username(alice, settings):
    # What a client gets when a front server rewrites REMOTE_ADDR from a header it is sent:
    # a new address on every attempt. The count is the username's, wherever it comes from.
    for i in range(20):
        login(Client(REMOTE_ADDR=f"203.0.113.{i}"), "alice", "wrong")
    assert login(Client(REMOTE_ADDR="198.51.100.7"), "alice", PASSWORD).status_code == 429


@pytest.mark.django_db
def test_the_lockout_counts_per_username_and_per_trustworthy_address(alice, settings):
    bob = UserFactory(username="bob", role="reviewer")
    bob.set_password(PASSWORD)
    bob.save()
    carol = UserFactory(username="carol", role="reviewer")
    carol.set_password(PASSWORD)
    carol.save()
    attacker = Client(REMOTE_ADDR="203.0.113.9")
    for i in range(settings.AXES_FAILURE_LIMIT):
        login(attacker, f"nobody-{i}", "wrong")  # one address, many usernames
    assert login(Client(REMOTE_ADDR="203.0.113.9"), "bob", PASSWORD).status_code == 429
    assert login(Client(REMOTE_ADDR="198.51.100.7"), "carol", PASSWORD).status_code == 302


@pytest.mark.django_db
def test_the_client_written_part_of_x_forwarded_for_is_never_believed(alice, settings):
    attacker = Client(REMOTE_ADDR="203.0.113.9")
    for i in range(settings.AXES_FAILURE_LIMIT):
        login(attacker, "alice", "wrong", HTTP_X_FORWARDED_FOR=f"1.2.3.{i}")
    assert login(attacker, "alice", PASSWORD,
                 HTTP_X_FORWARDED_FOR="9.9.9.9").status_code == 429


@pytest.mark.django_db
def test_behind_a_trusted_proxy_the_lockout_keys_on_the_address_the_proxy_saw(
        alice, settings):
    settings.LEDGER_TRUSTED_PROXY_COUNT = 1
    bob = UserFactory(username="bob", role="reviewer")
    bob.set_password(PASSWORD)
    bob.save()
    proxy = {"REMOTE_ADDR": "10.0.0.2"}
    attacker = Client(**proxy)
    for i in range(settings.AXES_FAILURE_LIMIT):
        # The client-written part of the header changes every time; it is not trusted.
        login(attacker, f"nobody-{i}", "wrong", HTTP_X_FORWARDED_FOR=f"1.2.3.{i}, 203.0.113.9")
    # The address the proxy saw is locked for every username; others behind it are not.
    assert login(attacker, "bob", PASSWORD,
                 HTTP_X_FORWARDED_FOR="9.9.9.9, 203.0.113.9").status_code == 429
    assert login(Client(**proxy), "bob", PASSWORD,
                 HTTP_X_FORWARDED_FOR="198.51.100.7").status_code == 302


@pytest.mark.django_db
def test_an_address_that_cannot_be_trusted_locks_no_one_but_the_username(alice, settings):
    # Proxies configured, but the header is missing: REMOTE_ADDR is the proxy itself,
    # shared by everyone behind it, so it is not counted (the username still is).
    settings.LEDGER_TRUSTED_PROXY_COUNT = 1
    bob = UserFactory(username="bob", role="reviewer")
    bob.set_password(PASSWORD)
    bob.save()
    for i in range(settings.AXES_FAILURE_LIMIT):
        login(Client(REMOTE_ADDR="10.0.0.2"), f"nobody-{i}", "wrong")
    assert login(Client(REMOTE_ADDR="10.0.0.2"), "bob", PASSWORD).status_code == 302
    for _ in range(settings.AXES_FAILURE_LIMIT):
        login(Client(REMOTE_ADDR="10.0.0.2"), "alice", "wrong")
    assert login(Client(REMOTE_ADDR="10.0.0.2"), "alice", PASSWORD).status_code == 429


@pytest.mark.django_db
def test_every_desk_page_that_shows_intents_is_sent_no_store(client, admin_user):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    client.force_login(admin_user)
    pages = ["/", f"/operations/{op.operation_id}/", "/audit/", "/audit/export.csv",
             "/conflicts/", "/obligations/overdue/", "/retention/", "/accounts/login/"]
    for url in pages:
        response = client.get(url)
        assert response.status_code == 200, url
        assert "no-store" in response["Cache-Control"], url
        assert "private" in response["Cache-Control"], url
    fragment = client.get("/", headers={"HX-Request": "true"})
    assert "no-store" in fragment["Cache-Control"]


@pytest.mark.django_db
def test_a_failed_csrf_check_shows_the_desks_own_page(alice):
    client = Client(enforce_csrf_checks=True)
    response = login(client, "alice", PASSWORD)
    assert response.status_code == 403
    page = response.content.decode()
    assert "This form could not be accepted" in page and "nothing was changed" in page
    assert 'href="/static/desk/desk.css"' in page  # the desk's look, not Django's bare page
    assert not is_logged_in(client)
