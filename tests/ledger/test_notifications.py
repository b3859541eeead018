"""ledger.notifications: channels, once-per-item batches, signed webhook deliveries with
retries, e-mail, and the database's guarantees behind them. Real PostgreSQL, a real HTTP
receiver on loopback, real threads."""

from __future__ import annotations

import io
import json
import shutil
import socket
import ssl
import subprocess
import threading
import urllib.error
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.core import mail
from django.core.management import call_command
from django.db import DatabaseError, IntegrityError, connection, transaction
from django.utils import timezone

from ledger import approvals, metrics, notifications
from ledger.errors import InvalidInput, PermissionDenied
from ledger.models import (
    DeliveryAttempt,
    NotificationBatch,
    NotificationChannel,
    NotificationChannelChange,
    NotificationSent,
)
from ledger.states import State
from tests.factories import OperationFactory, UserFactory
from tests.ledger.test_secrets import ledger_tables
from tests.support.concurrency import join, run_threads

SECRET = "whsec-NotifyQ7-0f3b9c2a7d"
LATER = timedelta(minutes=5)  # past the outcome_unknown grace of the queue


class Receiver:
    """A webhook receiver on loopback: records every request, answers the scripted codes
    (then 200)."""

    def __init__(self, codes=(), answer=b"ok", tls: ssl.SSLContext | None = None):
        self.codes = list(codes)
        self.answer = answer
        self.requests: list[tuple[dict, bytes]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.requests.append((dict(self.headers), body))
                code = receiver.codes.pop(0) if receiver.codes else 200
                self.send_response(code)
                self.send_header("Content-Length", str(len(receiver.answer)))
                self.end_headers()
                self.wfile.write(receiver.answer)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/hooks/ledger"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    made = []

    def make(codes=()):
        made.append(Receiver(codes))
        return made[-1]

    yield make
    for r in made:
        r.close()


@pytest.fixture(autouse=True)
def secrets(settings):
    settings.LEDGER_WEBHOOK_SECRETS = {"PAYMENTS": SECRET}
    settings.LEDGER_DESK_URL = "https://desk.example"


def webhook(admin, url, **kwargs):
    values = {"name": "payments-hook", "kind": "webhook", "pattern": "payments.*",
              "url": url, "secret_name": "PAYMENTS", **kwargs}
    return notifications.create_channel(values.pop("name"), user=admin, **values)


def unknown_ops(n, operation="payments.charge", tenant="default"):
    return [OperationFactory(operation=operation, tenant=tenant, state=State.OUTCOME_UNKNOWN)
            for _ in range(n)]


def verify(request, secret=SECRET):
    headers, body = request
    return notifications.verify_signature(
        secret, timestamp=headers["X-Ledger-Timestamp"],
        signature_header=headers["X-Ledger-Signature"], body=body)


@pytest.mark.django_db
def test_a_burst_of_500_items_is_one_signed_batched_delivery(admin_user, receiver):
    hook = receiver()
    webhook(admin_user, hook.url)
    ops = unknown_ops(500)
    OperationFactory(operation="articles.create", state=State.OUTCOME_UNKNOWN)  # other pattern
    now = timezone.now() + LATER

    assert notifications.run_once(worker="w1", now=now) == (1, 1)

    [request] = hook.requests
    headers, body = request
    assert verify(request)
    assert not verify(request, secret="another secret")
    assert headers["X-Ledger-Signature"].startswith("sha256=")
    payload = json.loads(body)
    assert payload["total"] == 500
    assert payload["counts"] == {"queue": 500, "approval": 0, "stuck": 0}
    assert len(payload["items"]) == 20  # LEDGER_NOTIFY_ITEMS_PER_MESSAGE
    assert payload["more"] == 480
    first = payload["items"][0]
    assert first["url"] == f"https://desk.example/operations/{ops[0].operation_id}/"
    assert first["operation"] == "payments.charge"
    assert NotificationSent.objects.count() == 500
    [attempt] = DeliveryAttempt.objects.all()
    assert (attempt.is_ok, attempt.status_code, attempt.attempt) == (True, 200, 1)
    assert NotificationBatch.objects.get().status == "delivered"

    # A later pass tells nothing again.
    assert notifications.run_once(worker="w1", now=now + LATER) == (0, 0)
    assert len(hook.requests) == 1


@pytest.mark.django_db
def test_an_outcome_unknown_item_waits_for_the_grace_but_manual_review_is_told_at_once(
        admin_user, receiver):
    hook = receiver()
    webhook(admin_user, hook.url)
    unknown_ops(1)
    review = OperationFactory(operation="payments.refund", state=State.MANUAL_REVIEW)
    notifications.run_once(now=timezone.now())
    [request] = hook.requests
    assert [i["id"] for i in json.loads(request[1])["items"]] == [review.operation_id]


@pytest.mark.django_db
def test_a_failed_delivery_is_retried_with_backoff_then_succeeds(admin_user, receiver):
    hook = receiver(codes=[500])
    webhook(admin_user, hook.url)
    unknown_ops(3)
    t0 = timezone.now() + LATER

    notifications.run_once(worker="w1", now=t0)
    batch = NotificationBatch.objects.get()
    assert batch.status == "pending"
    assert batch.next_attempt_at == t0 + timedelta(seconds=30)
    # Not due yet: nothing is sent.
    assert notifications.deliver_due(now=t0 + timedelta(seconds=29)) == []
    [retry] = notifications.deliver_due(worker="w2", now=t0 + timedelta(seconds=31))
    assert retry.is_ok

    first, second = DeliveryAttempt.objects.order_by("attempt")
    assert (first.attempt, first.status_code, first.is_ok) == (1, 500, False)
    assert first.error.startswith("expected a 2xx answer, found 500")
    assert (second.attempt, second.status_code, second.worker) == (2, 200, "w2")
    assert len(hook.requests) == 2
    assert hook.requests[0][1] == hook.requests[1][1]  # the same body, the same delivery id
    assert hook.requests[0][0]["X-Ledger-Delivery"] == hook.requests[1][0]["X-Ledger-Delivery"]
    assert all(verify(r) for r in hook.requests)
    assert NotificationBatch.objects.get().status == "delivered"


def test_backoff_doubles_up_to_its_cap(settings):
    settings.LEDGER_NOTIFY_BACKOFF_SECONDS = 30
    settings.LEDGER_NOTIFY_BACKOFF_CAP_SECONDS = 100
    assert [notifications.backoff(n).total_seconds() for n in (1, 2, 3, 4, 50)] == [
        30, 60, 100, 100, 100]


@pytest.mark.django_db
def test_a_delivery_is_given_up_after_the_last_attempt_and_counted_in_metrics(
        admin_user, receiver, settings):
    settings.LEDGER_NOTIFY_MAX_ATTEMPTS = 2
    hook = receiver(codes=[503, 503, 503])
    webhook(admin_user, hook.url)
    unknown_ops(1)
    t0 = timezone.now() + LATER
    notifications.run_once(now=t0)
    notifications.deliver_due(now=t0 + timedelta(hours=1))
    assert notifications.deliver_due(now=t0 + timedelta(hours=2)) == []
    batch = NotificationBatch.objects.get()
    assert (batch.status, batch.attempts) == ("failed", 2)
    assert len(hook.requests) == 2
    text = metrics.render().decode()
    assert "ledger_notification_delivery_failures_total 2.0" in text
    assert 'ledger_notification_batches_undelivered{status="failed"} 1.0' in text
    assert 'ledger_notification_batches_undelivered{status="pending"} 0.0' in text


@pytest.mark.django_db
def test_an_unreachable_receiver_is_logged_as_an_error_without_a_status(admin_user, receiver):
    hook = receiver()
    url = hook.url
    hook.close()
    webhook(admin_user, url)
    unknown_ops(1)
    later = timezone.now() + LATER
    assert len(notifications.collect(now=later)) == 1
    [attempt] = notifications.deliver_due(now=later)
    assert not attempt.is_ok
    assert attempt.status_code is None
    assert "URLError" in attempt.error or "Connection" in attempt.error


@pytest.mark.django_db
def test_email_arrives_with_deep_links(admin_user):
    notifications.create_channel("on-call", user=admin_user, kind="email", pattern="*",
                                 recipients=["oncall@example.com"])
    review = OperationFactory(operation="mail.send", state=State.MANUAL_REVIEW)
    planned = OperationFactory(operation="payments.charge")
    approvals.request(planned, note="big one")

    notifications.run_once(now=timezone.now())

    [message] = mail.outbox
    assert message.to == ["oncall@example.com"]
    assert message.subject == "[Agent Ledger] 2 items need a person (default, *)"
    assert f"https://desk.example/operations/{review.operation_id}/" in message.body
    assert f"https://desk.example/operations/{planned.operation_id}/" in message.body
    assert "Awaits approval: 1" in message.body
    assert "Entered the review queue: 1" in message.body


@pytest.mark.django_db
def test_an_item_waiting_longer_than_the_threshold_is_told_once_as_stuck(admin_user, receiver):
    hook = receiver()
    webhook(admin_user, hook.url, on_queue=False, on_approval=False,
            stuck_after=timedelta(hours=1))
    op = OperationFactory(operation="payments.charge", state=State.MANUAL_REVIEW)
    now = timezone.now()
    assert notifications.run_once(now=now + timedelta(minutes=59)) == (0, 0)
    assert notifications.run_once(now=now + timedelta(minutes=61)) == (1, 1)
    payload = json.loads(hook.requests[0][1])
    assert payload["counts"] == {"queue": 0, "approval": 0, "stuck": 1}
    assert payload["items"][0]["id"] == op.operation_id
    assert notifications.run_once(now=now + timedelta(hours=5)) == (0, 0)


@pytest.mark.django_db
def test_a_restarted_notify_loop_does_not_resend(admin_user, receiver, settings):
    settings.LEDGER_NOTIFY_QUEUE_GRACE_SECONDS = 1
    hook = receiver()
    webhook(admin_user, hook.url)
    OperationFactory(operation="payments.charge", state=State.MANUAL_REVIEW)
    out = io.StringIO()
    call_command("notify", "--once", stdout=out)
    call_command("notify", "--once", stdout=out)  # a new process's pass
    assert len(hook.requests) == 1
    assert "attempt 1 (200," in out.getvalue()
    assert DeliveryAttempt.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_two_concurrent_notify_passes_deliver_once(receiver):
    admin = UserFactory(username="admin", role="admin")
    hook = receiver()
    webhook(admin, hook.url)
    unknown_ops(40)
    now = timezone.now() + LATER
    threads, results, errors = run_threads(
        4, lambda i: notifications.run_once(worker=f"w{i}", now=now))
    join(threads)
    assert errors == []
    assert sum(batches for batches, _ in results) == 1
    assert sum(attempts for _, attempts in results) == 1
    assert len(hook.requests) == 1
    assert json.loads(hook.requests[0][1])["total"] == 40
    assert NotificationSent.objects.count() == 40
    assert DeliveryAttempt.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_concurrent_delivery_workers_claim_each_batch_once(receiver):
    admin = UserFactory(username="admin", role="admin")
    hooks = [receiver() for _ in range(3)]
    for n, hook in enumerate(hooks):
        webhook(admin, hook.url, name=f"hook-{n}")
    unknown_ops(5)
    now = timezone.now() + LATER
    assert len(notifications.collect(now=now)) == 3
    threads, results, errors = run_threads(
        6, lambda i: len(notifications.deliver_due(worker=f"w{i}", now=now)))
    join(threads)
    assert errors == [] and sum(results) == 3
    assert [len(h.requests) for h in hooks] == [1, 1, 1]


@pytest.mark.django_db
def test_the_webhook_secret_reaches_no_table(admin_user, receiver):
    hook = receiver(codes=[500])
    webhook(admin_user, hook.url)
    unknown_ops(2)
    t0 = timezone.now() + LATER
    notifications.run_once(now=t0)
    notifications.run_once(now=t0 + timedelta(hours=1))
    assert DeliveryAttempt.objects.count() == 2
    with connection.cursor() as cursor:
        for table in ledger_tables():
            cursor.execute(f'SELECT t::text FROM "{table}" t')
            for (row,) in cursor.fetchall():
                assert SECRET not in row, table
    assert NotificationChannel.objects.get().secret_name == "PAYMENTS"


@pytest.mark.django_db
@pytest.mark.parametrize("url", [
    "https://deploy:pa55@hooks.example/ledger",
    "https://token@hooks.example/ledger",
    "https://hooks.example/ledger?api_key=abc123",
    "https://hooks.example/ledger?token=abc123",
    "ftp://hooks.example/ledger",
    "hooks.example/ledger",
])
def test_a_webhook_url_with_credentials_or_without_http_is_refused(admin_user, url):
    with pytest.raises(InvalidInput, match="expected a webhook URL"):
        webhook(admin_user, url)
    assert not NotificationChannel.objects.exists()


@pytest.mark.django_db
def test_an_unconfigured_secret_name_is_refused(admin_user):
    with pytest.raises(InvalidInput, match="expected a secret named BILLING in "
                                           "LEDGER_WEBHOOK_SECRETS .*found none"):
        webhook(admin_user, "https://hooks.example/x", secret_name="BILLING")
    with pytest.raises(InvalidInput, match="expected a secret name of capital letters"):
        webhook(admin_user, "https://hooks.example/x", secret_name="whsec-literal-secret")


@pytest.mark.django_db
def test_channels_need_the_admin_permission_and_the_tenant(reviewer, admin_user):
    with pytest.raises(PermissionDenied, match="expected permission "
                                               "ledger.add_notificationchannel"):
        webhook(reviewer, "https://hooks.example/x")
    with pytest.raises(PermissionDenied, match="expected admin to be granted tenant 'acme'"):
        webhook(admin_user, "https://hooks.example/x", tenant="acme")


@pytest.mark.django_db
def test_channel_changes_are_audited_and_a_disabled_channel_is_told_nothing(
        admin_user, receiver):
    hook = receiver()
    channel = webhook(admin_user, hook.url)
    notifications.set_channel_active(channel, user=admin_user, is_active=False)
    created, disabled = NotificationChannelChange.objects.order_by("changed_at", "id")
    assert created.before is None and created.after["url"] == hook.url
    assert (disabled.before["is_active"], disabled.after["is_active"]) == (True, False)
    assert disabled.changed_by_name == "admin"
    unknown_ops(2)
    assert notifications.run_once(now=timezone.now() + LATER) == (0, 0)
    assert hook.requests == []


@pytest.mark.django_db
def test_postgresql_refuses_credentials_in_a_channel_url_and_a_second_record_of_an_item(
        admin_user):
    channel = webhook(admin_user, "https://hooks.example/x")
    with pytest.raises(IntegrityError, match="notification_url_without_userinfo"), \
            transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("UPDATE ledger_notificationchannel SET url = "
                       "'https://user:pw@hooks.example/x' WHERE id = %s", [channel.pk])
    OperationFactory(operation="payments.charge", state=State.MANUAL_REVIEW)
    notifications.collect()
    sent = NotificationSent.objects.get()
    with pytest.raises(IntegrityError, match="notification_sent_once"), \
            transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO ledger_notificationsent (channel_id, batch_id, reason, item_key, "
            "operation_id, waiting_since, created_at) SELECT channel_id, batch_id, reason, "
            "item_key, operation_id, now(), now() FROM ledger_notificationsent WHERE id = %s",
            [sent.pk])


@pytest.mark.django_db
def test_postgresql_refuses_changing_the_delivery_log_and_channel_audit(admin_user, receiver):
    hook = receiver()
    webhook(admin_user, hook.url)
    unknown_ops(1)
    notifications.run_once(now=timezone.now() + LATER)
    for statement in ("UPDATE ledger_deliveryattempt SET is_ok = false",
                      "DELETE FROM ledger_deliveryattempt",
                      "UPDATE ledger_notificationchannelchange SET changed_by_name = 'x'",
                      "DELETE FROM ledger_notificationchannelchange"):
        with pytest.raises(DatabaseError, match="append-only"), transaction.atomic(), \
                connection.cursor() as cursor:
            cursor.execute(statement)
    assert DeliveryAttempt.objects.get().is_ok


@pytest.mark.django_db
def test_a_notify_pass_works_under_the_application_role(admin_user, receiver):
    from ledger.management.commands.app_role import create_app_role

    hook = receiver(codes=[500])
    webhook(admin_user, hook.url)
    notifications.create_channel("mail", user=admin_user, kind="email", pattern="*",
                                 recipients=["oncall@example.com"])
    unknown_ops(3)
    create_app_role("ledger_app_notify")
    t0 = timezone.now() + LATER
    with connection.cursor() as cursor:
        cursor.execute("SET ROLE ledger_app_notify")
        try:
            assert notifications.run_once(worker="app", now=t0) == (2, 2)
            assert notifications.run_once(worker="app", now=t0 + timedelta(minutes=1)) == (0, 1)
            with pytest.raises(DatabaseError), transaction.atomic():
                cursor.execute("DELETE FROM ledger_notificationsent")
        finally:
            cursor.execute("RESET ROLE")
    assert len(hook.requests) == 2 and len(mail.outbox) == 1
    assert NotificationBatch.objects.filter(status="delivered").count() == 2


@pytest.mark.django_db(transaction=True)
def test_the_notify_loop_delivers_in_its_own_process_and_stops_on_sigterm(receiver):
    import signal

    from tests.support.processes import spawn, wait_for_line

    admin = UserFactory(username="admin", role="admin")
    hook = receiver()
    webhook(admin, hook.url)
    OperationFactory(operation="payments.charge", state=State.MANUAL_REVIEW)
    child = spawn(f"""
        from django.conf import settings
        from django.core.management import call_command
        settings.LEDGER_WEBHOOK_SECRETS = {{"PAYMENTS": {SECRET!r}}}
        call_command("notify", "--interval", "0.2", "--worker-name", "loop-1")
    """)
    try:
        line = wait_for_line(child, "batch ")
        assert line.endswith("delivered")
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 0, err
    assert "notify: stopped; 1 batch(es), 1 delivery attempt(s)" in out
    assert len(hook.requests) == 1 and verify(hook.requests[0])
    assert DeliveryAttempt.objects.get().worker == "loop-1"


@pytest.mark.django_db
@pytest.mark.parametrize("host", ["127.0.0.1", "10.1.2.3", "169.254.169.254", "[::1]",
                                  "localhost"])
def test_a_webhook_to_an_internal_address_is_refused_unless_allowed(admin_user, settings, host):
    settings.LEDGER_WEBHOOK_ALLOW_PRIVATE = False
    with pytest.raises(InvalidInput, match=r"expected a webhook host on a public address "
                                           r"\(LEDGER_WEBHOOK_ALLOW_PRIVATE admits private "
                                           r"ones\), found .* at "):
        webhook(admin_user, f"http://{host}:8080/hook")
    assert not NotificationChannel.objects.exists()


@pytest.mark.django_db
def test_a_delivery_to_an_address_no_longer_allowed_is_logged_not_sent(
        admin_user, receiver, settings):
    hook = receiver()
    webhook(admin_user, hook.url)
    unknown_ops(2)
    settings.LEDGER_WEBHOOK_ALLOW_PRIVATE = False
    notifications.collect(now=timezone.now() + timedelta(minutes=5))
    [attempt] = notifications.deliver_due(now=timezone.now() + timedelta(minutes=5))
    assert "expected a webhook host on a public address" in attempt.error
    assert hook.requests == []


PUBLIC = "93.184.216.34"  # a public address; the test refuses to dial it


@pytest.mark.django_db
def test_a_delivery_connects_to_the_address_it_checked_not_to_a_second_answer(
        admin_user, receiver, settings, monkeypatch):
    # DNS rebinding: the name answers a public address to the check and loopback to any
    # look after it. The delivery dials the checked address and never resolves again, so
    # the receiver on loopback hears nothing.
    hook = receiver()
    port = hook.server.server_port
    settings.LEDGER_WEBHOOK_ALLOW_PRIVATE = False
    real_resolve, real_dial = socket.getaddrinfo, socket.create_connection
    looks, dialed = [], []

    def rebinding(host, port, *args, **kwargs):
        if host != "hooks.example":
            return real_resolve(host, port, *args, **kwargs)
        looks.append(host)
        ip = PUBLIC if len(looks) <= 2 else "127.0.0.1"  # the save's look, the delivery's
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (ip, port))]

    def dial(address, *args, **kwargs):
        dialed.append(address)
        if address[0] == PUBLIC:
            raise ConnectionRefusedError(f"{PUBLIC} is not dialed from a test")
        return real_dial(address, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    monkeypatch.setattr(socket, "create_connection", dial)
    webhook(admin_user, f"http://hooks.example:{port}/hooks/ledger")
    unknown_ops(2)
    notifications.collect(now=timezone.now() + timedelta(minutes=5))
    [attempt] = notifications.deliver_due(now=timezone.now() + timedelta(minutes=5))
    assert dialed == [(PUBLIC, port)]
    assert len(looks) == 2
    assert hook.requests == []
    assert "is not dialed from a test" in attempt.error and attempt.status_code is None


def test_a_delivery_through_a_proxy_leaves_the_name_to_the_proxy(monkeypatch):
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:3128")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    pinned = notifications._opener("http://hooks.example/h", PUBLIC)
    direct = notifications._opener("http://hooks.example/h", None)
    assert not any(isinstance(h, notifications._PinnedHTTPHandler) for h in pinned.handlers)
    assert not any(isinstance(h, notifications._PinnedHTTPHandler) for h in direct.handlers)
    monkeypatch.delenv("http_proxy")
    monkeypatch.delenv("HTTP_PROXY", raising=False)
    assert any(isinstance(h, notifications._PinnedHTTPHandler)
               for h in notifications._opener("http://hooks.example/h", PUBLIC).handlers)


@pytest.fixture
def tls_receiver(tmp_path):
    """A TLS receiver on loopback whose certificate names hooks.example (openssl makes it),
    and a client context that trusts that certificate alone."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("expected the openssl command to make a test certificate, found none")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key,
                    "-out", cert, "-days", "1", "-subj", "/CN=hooks.example",
                    "-addext", "subjectAltName=DNS:hooks.example"],
                   check=True, capture_output=True)
    server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_side.load_cert_chain(cert, key)
    hook = Receiver(tls=server_side)
    yield hook, ssl.create_default_context(cafile=str(cert))
    hook.close()


@pytest.mark.parametrize("name", ["hooks.example", "other.example"])
def test_a_pinned_tls_delivery_verifies_the_certificate_against_the_name(tls_receiver, name):
    # Neither name resolves here: what answers is the pinned address, and TLS checks the
    # certificate against the name in the URL, not against the address.
    hook, trusted = tls_receiver
    url = f"https://{name}:{hook.server.server_port}/hooks/ledger"
    opener = notifications._opener(url, "127.0.0.1")
    [pinned] = [h for h in opener.handlers if isinstance(h, notifications._PinnedHTTPSHandler)]
    pinned._context = trusted
    request = urllib.request.Request(url, data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
    if name == "hooks.example":
        with opener.open(request, timeout=10) as response:
            assert response.status == 200
        assert len(hook.requests) == 1
    else:
        with pytest.raises(urllib.error.URLError, match="Hostname mismatch"):
            opener.open(request, timeout=10)
        assert hook.requests == []
