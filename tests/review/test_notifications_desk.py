"""The Notifications page and the delivery log: admins only, tenant-scoped, audited writes,
escaped text, keyset pages at a fixed number of queries."""

from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from ledger import notifications
from ledger.models import DeliveryAttempt, NotificationChannel, NotificationChannelChange
from ledger.states import State
from tests.factories import OperationFactory, UserFactory
from tests.ledger.test_notifications import Receiver

PAGE = reverse("review:notifications")
ADD = reverse("review:notification_add")
LOG = reverse("review:notification_deliveries")
SECRET = "whsec-DeskQ7-5b1e0c"


@pytest.fixture(autouse=True)
def secrets(settings):
    settings.LEDGER_WEBHOOK_SECRETS = {"OPS": SECRET}


@pytest.fixture
def receiver():
    made = []

    def make(codes=(), answer=b"ok"):
        made.append(Receiver(codes, answer))
        return made[-1]

    yield make
    for r in made:
        r.close()


def new_channel(**overrides):
    data = {"name": "ops-hook", "tenant": "default", "kind": "webhook", "pattern": "payments.*",
            "url": "https://hooks.example/ledger", "secret_name": "OPS", "recipients": "",
            "on_queue": "on", "on_approval": "on", "stuck_minutes": "60"}
    data.update(overrides)
    return data


@pytest.mark.django_db
def test_an_admin_adds_a_channel_and_the_change_is_audited(client, admin_user):
    client.force_login(admin_user)
    response = client.post(ADD, new_channel())
    assert response.status_code == 302 and response.url == PAGE
    channel = NotificationChannel.objects.get()
    assert (channel.kind, channel.pattern, channel.stuck_after) == (
        "webhook", "payments.*", timedelta(hours=1))
    [change] = NotificationChannelChange.objects.all()
    assert change.changed_by == admin_user and change.before is None
    page = client.get(PAGE).content.decode()
    assert "ops-hook" in page and "signed with OPS" in page
    assert SECRET not in page


@pytest.mark.django_db
def test_a_refused_channel_says_why_and_writes_nothing(client, admin_user):
    client.force_login(admin_user)
    response = client.post(ADD, new_channel(url="https://me:pw@hooks.example/x"))
    assert response.status_code == 422
    assert "Nothing written: expected a webhook URL without credentials" in \
        response.content.decode()
    response = client.post(ADD, new_channel(secret_name="NOPE"))
    assert "expected a secret named NOPE in LEDGER_WEBHOOK_SECRETS" in response.content.decode()
    response = client.post(ADD, new_channel(kind="email", url="", secret_name="",
                                            recipients="not an address"))
    assert "expected e-mail addresses, found &#x27;not an address&#x27;" in \
        response.content.decode()
    assert not NotificationChannel.objects.exists()
    assert not NotificationChannelChange.objects.exists()


@pytest.mark.django_db
def test_an_admin_disables_a_channel_audited(client, admin_user):
    channel = notifications.create_channel("mail", user=admin_user, kind="email",
                                           recipients=["a@example.com"])
    client.force_login(admin_user)
    url = reverse("review:notification_active", args=[channel.pk])
    assert client.post(url, {"is_active": "0"}).status_code == 302
    channel.refresh_from_db()
    assert not channel.is_active
    assert NotificationChannelChange.objects.count() == 2
    assert "Enable" in client.get(PAGE).content.decode()


@pytest.mark.django_db
@pytest.mark.parametrize("role", ["viewer", "reviewer"])
def test_viewers_and_reviewers_are_refused_every_notification_page(client, role, admin_user):
    channel = notifications.create_channel("mail", user=admin_user, kind="email",
                                           recipients=["a@example.com"])
    client.force_login(UserFactory(username=f"the-{role}", role=role))
    assert client.get(PAGE).status_code == 403
    assert client.get(LOG).status_code == 403
    assert client.post(ADD, new_channel()).status_code == 403
    url = reverse("review:notification_active", args=[channel.pk])
    assert client.post(url, {"is_active": "0"}).status_code == 403
    assert NotificationChannel.objects.get().is_active
    assert "Notifications" not in client.get(reverse("review:queue")).content.decode()


@pytest.mark.django_db
def test_an_admin_of_another_tenant_sees_and_changes_none_of_its_channels(client, admin_user):
    channel = notifications.create_channel("default-mail", user=admin_user, kind="email",
                                           recipients=["a@example.com"])
    other = UserFactory(username="acme-admin", role="admin", tenants=["acme"])
    client.force_login(other)
    assert "default-mail" not in client.get(PAGE).content.decode()
    url = reverse("review:notification_active", args=[channel.pk])
    assert client.post(url, {"is_active": "0"}).status_code == 404
    assert client.post(ADD, new_channel(tenant="default")).status_code == 403
    assert NotificationChannel.objects.get().is_active


@pytest.mark.django_db
def test_hostile_text_is_escaped_on_both_pages(client, admin_user, receiver):
    hook = receiver(codes=[500], answer=b'<script>alert("answer")</script>')

    name = '<img src=x onerror=alert(1)>'
    notifications.create_channel(name, user=admin_user, kind="webhook", url=hook.url,
                                 secret_name="OPS", pattern="*")
    OperationFactory(operation="payments.charge", state=State.MANUAL_REVIEW)
    [attempt] = notifications.deliver_due() if notifications.collect() else []
    assert attempt.error == 'expected a 2xx answer, found 500: <script>alert("answer")</script>'
    client.force_login(admin_user)
    for url in (PAGE, LOG):
        page = client.get(url).content.decode()
        assert "<img src=x" not in page and "<script>alert" not in page
    assert "&lt;img src=x onerror=alert(1)&gt;" in client.get(PAGE).content.decode()
    assert "&lt;script&gt;alert(&quot;answer&quot;)&lt;/script&gt;" in \
        client.get(LOG).content.decode()


@pytest.mark.django_db
def test_the_delivery_log_pages_with_keysets_at_a_fixed_number_of_queries(
        client, admin_user, receiver, django_assert_num_queries):
    hook = receiver(codes=[500] * 60)
    notifications.create_channel("hook", user=admin_user, kind="webhook", url=hook.url,
                                 secret_name="OPS", pattern="*")
    OperationFactory(operation="payments.charge", state=State.MANUAL_REVIEW)
    t0 = timezone.now()
    notifications.collect(now=t0)
    batch = notifications.NotificationBatch.objects.get()
    for n in range(55):
        notifications._record(batch, status_code=500, error=f"failure {n}", duration_ms=n,
                              worker="w", now=t0 + timedelta(seconds=n))
    client.force_login(admin_user)
    client.get(LOG)  # warm the session and permission caches
    with django_assert_num_queries(6):
        first = client.get(LOG)
    page = first.context["page"]
    assert [a.error for a in page.items][:2] == ["failure 54", "failure 53"]
    assert len(page.items) == 50 and page.next_cursor
    second = client.get(LOG, {"cursor": page.next_cursor})
    assert [a.error for a in second.context["page"].items] == [
        f"failure {n}" for n in range(4, -1, -1)]
    assert "Older" not in second.content.decode().split('aria-label="Pages"')[1]
    bad = client.get(LOG, {"cursor": "nonsense"})
    assert bad.status_code == 200 and "expected a page cursor" in bad.content.decode()
    assert DeliveryAttempt.objects.count() == 55


@pytest.mark.django_db
def test_the_channels_page_runs_a_fixed_number_of_queries(client, admin_user,
                                                          django_assert_num_queries):
    client.force_login(admin_user)
    client.get(PAGE)

    def count():
        with django_assert_num_queries(7):
            client.get(PAGE)

    count()
    for n in range(3):
        notifications.create_channel(f"mail-{n}", user=admin_user, kind="email",
                                     recipients=["a@example.com"])
    count()


@pytest.mark.django_db
def test_htmx_gets_the_fresh_fragment_after_a_change(client, admin_user):
    channel = notifications.create_channel("mail", user=admin_user, kind="email",
                                           recipients=["a@example.com"])
    client.force_login(admin_user)
    response = client.post(reverse("review:notification_active", args=[channel.pk]),
                           {"is_active": "0"}, headers={"HX-Request": "true"})
    body = response.content.decode()
    assert response.status_code == 200
    assert body.lstrip().startswith('<section id="channels"') and "<html" not in body
    assert "Channel mail (email, default) disabled." in body and ">Enable<" in body
