"""The webhook address rule, form by form: every IPv6 way of writing an IPv4 address is
judged as that IPv4 address, at channel creation and before every delivery.

No test here sends anything: numeric literals resolve without DNS, and a refused address
is refused before any connection.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from ledger import notifications
from ledger.errors import InvalidInput
from ledger.models import NotificationChannel
from tests.ledger.test_notifications import SECRET, unknown_ops, webhook


@pytest.fixture(autouse=True)
def secrets(settings):
    settings.LEDGER_WEBHOOK_SECRETS = {"PAYMENTS": SECRET}


# (address as written in a URL's host, what the refusal must name; None: allowed)
TABLE = [
    # IPv4 itself
    ("127.0.0.1", "loopback"),
    ("127.8.9.10", "loopback"),
    ("10.1.2.3", "private"),
    ("172.16.0.1", "private"),
    ("192.168.1.1", "private"),
    ("169.254.169.254", "link-local"),
    ("0.0.0.0", "unspecified"),
    ("100.64.0.1", "not global"),
    ("224.0.0.1", "multicast"),
    ("239.255.255.250", "multicast"),
    ("255.255.255.255", "private"),
    ("93.184.216.34", None),
    # IPv6 itself
    ("[::1]", "loopback"),
    ("[::]", "unspecified"),
    ("[fe80::1]", "link-local"),
    ("[fec0::1]", "site-local"),
    ("[fc00::1]", "private"),
    ("[fd12:3456::1]", "private"),
    ("[ff02::1]", "multicast"),
    ("[ff0e::1]", "multicast"),
    ("[2001:db8::1]", "private"),
    ("[2606:2800:220:1:248:1893:25c8:1946]", None),
    # IPv4-mapped
    ("[::ffff:127.0.0.1]", "IPv4-mapped form of 127.0.0.1 (loopback)"),
    ("[::ffff:7f00:1]", "IPv4-mapped form of 127.0.0.1 (loopback)"),
    ("[::ffff:10.0.0.1]", "IPv4-mapped form of 10.0.0.1 (private)"),
    ("[::ffff:169.254.169.254]", "IPv4-mapped form of 169.254.169.254 (link-local)"),
    ("[::ffff:93.184.216.34]", None),
    # IPv4-compatible (deprecated)
    ("[::127.0.0.1]", "IPv4-compatible form of 127.0.0.1 (loopback)"),
    ("[::7f00:1]", "IPv4-compatible form of 127.0.0.1 (loopback)"),
    ("[::10.0.0.1]", "IPv4-compatible form of 10.0.0.1 (private)"),
    ("[::0.0.0.2]", "IPv4-compatible form of 0.0.0.2 (private)"),
    ("[::93.184.216.34]", None),
    # NAT64, well-known prefix
    ("[64:ff9b::7f00:1]", "NAT64 form of 127.0.0.1 (loopback)"),
    ("[64:ff9b::127.0.0.1]", "NAT64 form of 127.0.0.1 (loopback)"),
    ("[64:ff9b::a9fe:a9fe]", "NAT64 form of 169.254.169.254 (link-local)"),
    ("[64:ff9b::c0a8:101]", "NAT64 form of 192.168.1.1 (private)"),
    ("[64:ff9b::5db8:d822]", None),
    # NAT64, local-use prefix: always
    ("[64:ff9b:1::7f00:1]", "local-use NAT64 prefix"),
    ("[64:ff9b:1:5db8:d8:2200::]", "local-use NAT64 prefix"),
    # 6to4
    ("[2002:7f00:1::]", "6to4 form of 127.0.0.1 (loopback)"),
    ("[2002:a00:1::1]", "6to4 form of 10.0.0.1 (private)"),
    ("[2002:a9fe:a9fe::]", "6to4 form of 169.254.169.254 (link-local)"),
    ("[2002:5db8:d822::1]", None),
    # Teredo: always
    ("[2001:0:4136:e378:8000:63bf:80ff:fffe]", "Teredo"),
    ("[2001:0:5db8:d822:8000:63bf:a246:27dd]", "Teredo"),
]


@pytest.mark.parametrize(("host", "refusal"), TABLE)
def test_each_address_form_is_judged_by_the_address_it_reaches(settings, host, refusal):
    settings.LEDGER_WEBHOOK_ALLOW_PRIVATE = False
    url = f"http://{host}:8499/hook"
    if refusal is None:
        assert notifications.check_destination(url) is not None
    else:
        with pytest.raises(InvalidInput, match=r"expected a webhook host on a public address "
                                               r"\(LEDGER_WEBHOOK_ALLOW_PRIVATE admits private "
                                               r"ones\), found '.*' at "):
            notifications.check_destination(url)
        try:
            notifications.check_destination(url)
        except InvalidInput as refused:
            assert refusal in str(refused), str(refused)


@pytest.mark.django_db
@pytest.mark.parametrize("host", ["[::127.0.0.1]", "[64:ff9b::7f00:1]", "[2002:7f00:1::]",
                                  "[fec0::1]", "[::ffff:127.0.0.1]", "[64:ff9b:1::a00:1]"])
def test_the_forms_the_attack_used_are_refused_when_a_channel_is_created(
        admin_user, settings, host):
    settings.LEDGER_WEBHOOK_ALLOW_PRIVATE = False
    with pytest.raises(InvalidInput, match="expected a webhook host on a public address"):
        webhook(admin_user, f"http://{host}:8499/")
    assert not NotificationChannel.objects.exists()


@pytest.mark.django_db
def test_a_channel_now_resolving_to_an_embedded_loopback_is_refused_at_delivery(
        admin_user, settings, monkeypatch):
    # Saved while its name answered a public address; now it answers a 6to4 form of
    # loopback. The delivery is logged as refused and nothing connects.
    real = notifications.socket.getaddrinfo
    answers = {"hooks.example": "93.184.216.34"}

    def resolve(host, port, *args, **kwargs):
        if host in answers:
            return real(answers[host], port, *args, **kwargs)
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(notifications.socket, "getaddrinfo", resolve)
    settings.LEDGER_WEBHOOK_ALLOW_PRIVATE = False
    webhook(admin_user, "http://hooks.example:8499/hook")
    unknown_ops(2)
    answers["hooks.example"] = "2002:7f00:1::"
    connected = []
    monkeypatch.setattr(notifications.socket, "create_connection",
                        lambda *a, **k: connected.append(a))
    notifications.collect(now=timezone.now() + timedelta(minutes=5))
    [attempt] = notifications.deliver_due(now=timezone.now() + timedelta(minutes=5))
    assert "6to4 form of 127.0.0.1 (loopback)" in attempt.error
    assert connected == []
