"""The demo's notification channel and its catcher: a real delivery over HTTP to the
running server, signature verified, listed on the catcher's page (escaped)."""

import io
import json
import time

import pytest
from django.urls import reverse

from demo import notifications as demo_notifications
from ledger import notifications
from ledger.models import DeliveryAttempt, NotificationChannel
from ledger.states import State
from tests.factories import OperationFactory, UserFactory

DEMO_SECRET = "demo-secret-for-this-test"


@pytest.fixture(autouse=True)
def demo_settings(settings, tmp_path):
    settings.LEDGER_WEBHOOK_SECRETS = {"DEMO": DEMO_SECRET}
    settings.DEMO_CATCHER_FILE = tmp_path / "received.jsonl"


@pytest.mark.django_db(transaction=True)
def test_the_demo_channel_delivers_to_the_catcher_which_verifies_and_lists_it(
        live_server, settings, client):
    settings.LEDGER_DESK_URL = live_server.url
    admin = UserFactory(username="admin", role="admin")
    out = io.StringIO()
    channel = demo_notifications.seed_notification_channel(out, user=admin)
    assert demo_notifications.seed_notification_channel(out, user=admin) == channel  # once
    assert NotificationChannel.objects.count() == 1
    assert channel.url == f"{live_server.url}/demo/webhook-catcher/"
    op = OperationFactory(operation="articles.create", state=State.MANUAL_REVIEW)

    assert notifications.run_once(worker="demo") == (1, 1)
    assert DeliveryAttempt.objects.get().is_ok

    [received] = demo_notifications.received()
    assert received["signature_verified"] is True
    assert received["payload"]["items"][0]["url"] == \
        f"{live_server.url}/operations/{op.operation_id}/"
    client.force_login(admin)
    page = client.get(reverse("demo:webhook_catcher")).content.decode()
    assert op.operation_id in page and "signature verified" in page


@pytest.mark.django_db
def test_a_demo_served_on_another_port_gets_its_own_channel_and_the_old_one_is_disabled(
        settings):
    admin = UserFactory(username="admin", role="admin")
    settings.LEDGER_DESK_URL = "http://127.0.0.1:8000"
    first = demo_notifications.seed_notification_channel(io.StringIO(), user=admin)
    settings.LEDGER_DESK_URL = "http://127.0.0.1:8741"
    out = io.StringIO()
    second = demo_notifications.seed_notification_channel(out, user=admin)
    assert (second.name, second.url, second.is_active) == (
        "demo-catcher-8741", "http://127.0.0.1:8741/demo/webhook-catcher/", True)
    first.refresh_from_db()
    assert first.name == "demo-catcher" and not first.is_active
    assert "demo-catcher disabled: it delivers to http://127.0.0.1:8000/" in out.getvalue()
    # Back on the first port: its channel is enabled again, the other one disabled, and
    # nothing new is created; seeding twice changes nothing.
    settings.LEDGER_DESK_URL = "http://127.0.0.1:8000"
    again = demo_notifications.seed_notification_channel(io.StringIO(), user=admin)
    assert demo_notifications.seed_notification_channel(io.StringIO(), user=admin) == again
    assert again.pk == first.pk and again.is_active
    second.refresh_from_db()
    assert not second.is_active and NotificationChannel.objects.count() == 2
    # Each change is audited like any other: created, disabled, enabled again.
    assert first.changes.count() == 3 and second.changes.count() == 2


@pytest.mark.django_db
def test_the_catcher_refuses_a_wrong_signature_and_escapes_what_it_lists(client):
    body = json.dumps({"total": 1, "tenant": "<b>t</b>", "channel": "c", "counts": {},
                       "items": [], "more": 0}).encode()
    stamp = str(int(time.time()))
    url = reverse("demo:webhook_catcher")
    wrong = client.post(url, body, content_type="application/json",
                        headers={"X-Ledger-Timestamp": stamp,
                                 "X-Ledger-Signature": notifications.signature("nope", stamp,
                                                                               body)})
    assert wrong.status_code == 401
    assert wrong.headers["Content-Type"] == "application/problem+json"
    assert demo_notifications.received() == []
    good = client.post(url, body, content_type="application/json",
                       headers={"X-Ledger-Timestamp": stamp,
                                "X-Ledger-Signature": notifications.signature(DEMO_SECRET,
                                                                              stamp, body)})
    assert good.status_code == 200
    client.force_login(UserFactory(username="viewer", role="viewer"))
    with assert_no_log_records("django.request"):
        refused = client.get(url)
    assert refused.status_code == 403  # what arrived names every tenant's items
    assert "The webhook catcher is for admins only" in refused.content.decode()
    assert "&lt;b&gt;t&lt;/b&gt;" not in refused.content.decode()
    client.force_login(UserFactory(username="admin-1", role="admin"))
    page = client.get(url).content.decode()
    assert "&lt;b&gt;t&lt;/b&gt;" in page and "<b>t</b>" not in page


@pytest.mark.django_db
def test_without_the_demo_secret_there_is_no_catcher_and_no_channel(client, settings):
    settings.LEDGER_WEBHOOK_SECRETS = {}
    assert client.post(reverse("demo:webhook_catcher"), b"{}",
                       content_type="application/json").status_code == 404
    out = io.StringIO()
    assert demo_notifications.seed_notification_channel(
        out, user=UserFactory(username="admin", role="admin")) is None
    assert "LEDGER_WEBHOOK_SECRET_DEMO is not set" in out.getvalue()


def test_the_anonymous_get_of_the_catcher_goes_to_the_login(client, db):
    response = client.get(reverse("demo:webhook_catcher"))
    assert response.status_code == 302 and "/accounts/login/" in response.url


class assert_no_log_records:
    """Fails when `name` (or a child) logs a traceback: a refusal the page explains needs
    none in the server's log (Django's one-line "Forbidden: /path" is fine)."""

    def __init__(self, name: str):
        import logging

        self.logger, self.records = logging.getLogger(name), []
        self.handler = logging.Handler()
        self.handler.emit = self.records.append

    def __enter__(self):
        self.logger.addHandler(self.handler)

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)
        traced = [r.getMessage() for r in self.records if r.exc_info]
        assert traced == [], f"expected no traceback logged, found one for {traced}"
