"""Telling people that items wait for them: channels, batches, deliveries.

Admins configure channels (`create_channel`, `set_channel_active`; both audited) per tenant
and operation-name glob: a webhook (a signed JSON POST) or e-mail (Django's mail backend).
A notify pass (`run_once`, the loop `manage.py notify`; never a web request) does two things:

- `collect`: for each active channel, the items it has not been told about yet: operations
  that entered the review queue (manual_review at once; outcome_unknown after
  `LEDGER_NOTIFY_QUEUE_GRACE_SECONDS`, the reconciler's chance), planned operations awaiting
  approval, and (channels with `stuck_after`) items waiting longer than that; open fact
  conflicts too on channels whose pattern is `*`. Each (channel, reason, item) is inserted
  once into `ledger_notificationsent` (a unique constraint, ON CONFLICT DO NOTHING, so two
  workers or a restart never tell twice) and what one pass inserted becomes ONE batch per
  channel: counts per reason and the first `LEDGER_NOTIFY_ITEMS_PER_MESSAGE` items with deep
  links to the desk (`LEDGER_DESK_URL`).
- `deliver_due`: batches that are due are claimed with FOR UPDATE SKIP LOCKED (the claim
  pushes `next_attempt_at` past the timeout, so a crashed worker's batch is retried later),
  sent outside any transaction, and every attempt is logged (`DeliveryAttempt`: status code,
  error, duration). A failure is retried after `LEDGER_NOTIFY_BACKOFF_SECONDS`, doubled
  each time up to `LEDGER_NOTIFY_BACKOFF_CAP_SECONDS`, at most `LEDGER_NOTIFY_MAX_ATTEMPTS`
  times; then the batch is `failed`.

A webhook body is signed: `X-Ledger-Signature: sha256=<hex>` is HMAC-SHA256, keyed with the
channel's secret, of `<X-Ledger-Timestamp>.<body>` (`signature`, `verify_signature`). The
secret never reaches the database: a channel stores only its name in
`LEDGER_WEBHOOK_SECRETS`. Webhook URLs carrying credentials are refused.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import ipaddress
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from urllib.parse import quote, urlsplit

from django.core.exceptions import ValidationError
from django.core.mail import EmailMessage
from django.core.validators import validate_email
from django.db import IntegrityError, connection, transaction
from django.utils import timezone
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ledger import access, conf, metrics
from ledger.canonical import REDACTED, scrub_text
from ledger.errors import InvalidInput
from ledger.inputs import check_identifier, check_operation_pattern, check_positive_duration
from ledger.models import Operation
from ledger.models.approval_gate import pattern_matches_sql
from ledger.models.notifications import (
    DeliveryAttempt,
    NotificationBatch,
    NotificationChannel,
    NotificationChannelChange,
    NotificationSent,
)
from ledger.states import QUEUE_STATES, RECONCILABLE, State

Reason = NotificationSent.Reason
Kind = NotificationChannel.Kind

SIGNATURE_HEADER = "X-Ledger-Signature"
TIMESTAMP_HEADER = "X-Ledger-Timestamp"
DELIVERY_HEADER = "X-Ledger-Delivery"
# Items one pass takes per channel; a larger backlog is told over the next passes.
MAX_ITEMS_PER_PASS = 10_000
MAX_RECIPIENTS = 50
MAX_ERROR = 500
# Beyond the timeout, how long a claimed batch stays with the worker that claimed it.
CLAIM_MARGIN = timedelta(seconds=60)
_SECRET_NAME_CHARS = set("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")


# --- channels (admins) -----------------------------------------------------------------------


def check_webhook_url(url: str) -> str:
    """An http(s) URL with a host and no credentials (no userinfo, no secret-looking query
    parameter): anything the credential scrubber would change is refused, not stored."""
    if not isinstance(url, str) or not url:
        raise InvalidInput(f"expected a webhook URL such as https://hooks.example/ledger, "
                           f"found {url!r}")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidInput("expected a webhook URL starting http:// or https:// with a host, "
                           f"found {scrub_text(url)[:200]!r}")
    if len(url) > 2000:
        raise InvalidInput(f"expected a webhook URL of at most 2000 characters, found {len(url)}")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise InvalidInput("expected a webhook URL without credentials (the HMAC secret "
                           "authenticates the ledger), found user information before the host")
    if scrub_text(url) != url or any(c.isspace() for c in url):
        raise InvalidInput("expected a webhook URL without credentials (the HMAC secret "
                           "authenticates the ledger), found a secret-looking part: "
                           f"{scrub_text(url)[:200]!r}")
    return url


# IPv6 forms that carry an IPv4 address, and where it sits. A host reached through one of
# them is the IPv4 host, so it is judged as that host.
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")  # deprecated ::a.b.c.d
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # RFC 6052 well-known prefix
# RFC 8215's local-use NAT64 prefix: the IPv4 address may sit at any of RFC 6052's offsets
# and the translator is by definition inside the operator's network. Refused outright.
_NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")
_SITE_LOCAL = ipaddress.IPv6Network("fec0::/10")  # deprecated, still routed by some stacks


def address_refusal(address: str) -> str | None:
    """Why a webhook may not connect to `address` (an IPv4 or IPv6 literal, as resolved),
    or None when it may: the one address rule of webhooks, applied when a channel is saved
    and before every delivery (`check_destination`).

    Refused: loopback, private (RFC 1918, unique-local fc00::/7), link-local, site-local
    fec0::/10, multicast, unspecified, shared (100.64/10) and every other address Python's
    `ipaddress` does not call global; and each IPv6 form that maps or embeds an IPv4 address
    (::ffff:a.b.c.d, ::a.b.c.d, NAT64 64:ff9b::/96, 6to4 2002::/16, Teredo 2001::/32) when
    the IPv4 address inside is refused; the local-use NAT64 prefix 64:ff9b:1::/48 and
    Teredo always. Never connects, never resolves.
    """
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return f"{address!r}, not an IP address"
    if isinstance(ip, ipaddress.IPv6Address):
        if ip in _NAT64_LOCAL:
            return f"{ip}, in the local-use NAT64 prefix {_NAT64_LOCAL}"
        if ip.teredo is not None:
            return f"{ip}, a Teredo address (relayed to an IPv4 host the relay chooses)"
        embedded, form = _embedded_ipv4(ip)
        if embedded is not None:
            inner = _refusal_of(embedded)
            return f"{ip}, {form} of {embedded} ({inner})" if inner else None
    reason = _refusal_of(ip)
    return f"{ip} ({reason})" if reason else None


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> tuple[ipaddress.IPv4Address | None, str]:
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped, "the IPv4-mapped form"
    if ip.sixtofour is not None:
        return ip.sixtofour, "the 6to4 form"
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF), "the NAT64 form"
    if ip in _IPV4_COMPATIBLE and int(ip) > 1:  # :: and ::1 are themselves
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF), "the IPv4-compatible form"
    return None, ""


def _refusal_of(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    for name, refused in (
        ("unspecified", ip.is_unspecified), ("loopback", ip.is_loopback),
        ("link-local", ip.is_link_local), ("multicast", ip.is_multicast),
        ("site-local", isinstance(ip, ipaddress.IPv6Address) and ip in _SITE_LOCAL),
        ("private", ip.is_private), ("not global", not ip.is_global),
    ):
        if refused:
            return name
    return None


def check_destination(url: str) -> str | None:
    """Refuse a webhook whose host resolves to an address `address_refusal` refuses
    (loopback, private, link-local, site-local, multicast, unspecified, or any of these
    inside an IPv6 form), unless `LEDGER_WEBHOOK_ALLOW_PRIVATE`: an admin of one tenant
    must not aim the ledger's requests (and the answers shown in the delivery log) at
    internal services. Every address the host resolves to is checked, when a channel is
    saved and again before every delivery, which connects to the address returned here
    (the first the host resolved to; None when private ones are allowed) rather than
    resolving the name a second time: a name that answers a public address to the check
    and a private one to the connection (DNS rebinding) reaches nothing but the address
    checked. Redirects are never followed (`_NoRedirect`), so no answer can send the
    delivery elsewhere."""
    if conf.WEBHOOK_ALLOW_PRIVATE:
        return None
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        found = socket.getaddrinfo(parts.hostname, port, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as exc:
        raise InvalidInput(f"expected a webhook host that resolves, found {parts.hostname!r} "
                           f"not resolving ({exc})") from None
    for *_, address in found:
        refusal = address_refusal(address[0])
        if refusal is not None:
            raise InvalidInput(
                f"expected a webhook host on a public address (LEDGER_WEBHOOK_ALLOW_PRIVATE "
                f"admits private ones), found {parts.hostname!r} at {refusal}")
    return found[0][4][0]


def check_secret_name(name: str) -> str:
    """A key of `LEDGER_WEBHOOK_SECRETS` that is configured; the secret itself is not read
    into any message."""
    if not isinstance(name, str) or not name or not set(name) <= _SECRET_NAME_CHARS \
            or len(name) > 100:
        raise InvalidInput("expected a secret name of capital letters, digits and _ (the "
                           "<NAME> of LEDGER_WEBHOOK_SECRET_<NAME>), found "
                           f"{str(name)[:100]!r}")
    if name not in conf.WEBHOOK_SECRETS:
        raise InvalidInput(f"expected a secret named {name} in LEDGER_WEBHOOK_SECRETS (set the "
                           f"environment variable LEDGER_WEBHOOK_SECRET_{name}), found none")
    return name


def _check_recipients(recipients: Iterable[str]) -> list[str]:
    addresses = [r.strip() for r in recipients if isinstance(r, str) and r.strip()]
    if not addresses or len(addresses) > MAX_RECIPIENTS:
        raise InvalidInput(f"expected 1 to {MAX_RECIPIENTS} e-mail recipients, found "
                           f"{len(addresses)}")
    for address in addresses:
        try:
            validate_email(address)
        except ValidationError:
            raise InvalidInput(f"expected e-mail addresses, found {address[:200]!r}") from None
    return addresses


def create_channel(
    name: str,
    *,
    user,
    kind: str,
    tenant: str = "default",
    pattern: str = "*",
    url: str = "",
    secret_name: str = "",
    recipients: Sequence[str] = (),
    on_queue: bool = True,
    on_approval: bool = True,
    stuck_after: timedelta | None = None,
) -> NotificationChannel:
    """A new active channel of `tenant`; the creation is audited.

    Needs `ledger.add_notificationchannel` and the tenant grant. A webhook needs `url`
    (no credentials in it) and `secret_name`, configured in `LEDGER_WEBHOOK_SECRETS`; an
    e-mail channel needs `recipients`. Raises InvalidInput, writing nothing, otherwise.
    """
    check_identifier(name, "channel name", 100)
    check_identifier(tenant, "tenant", 100)
    check_operation_pattern(pattern)
    if kind not in Kind.values:
        raise InvalidInput(f"expected a channel kind of {' or '.join(Kind.values)}, "
                           f"found {str(kind)[:50]!r}")
    if stuck_after is not None:
        check_positive_duration(stuck_after, "stuck_after")
    if not any([on_queue, on_approval, stuck_after is not None]):
        raise InvalidInput("expected at least one reason to notify (queue, approval or a "
                           "stuck threshold), found none")
    if kind == Kind.WEBHOOK:
        check_webhook_url(url)
        check_secret_name(secret_name)
        check_destination(url)
        addresses: list[str] = []
    else:
        if url or secret_name:
            raise InvalidInput("expected no URL and no secret name on an e-mail channel, "
                               "found one")
        addresses = _check_recipients(recipients)
    access.require_perm(user, "ledger.add_notificationchannel", doing="add notification channels")
    access.require_tenant(user, tenant)
    now = timezone.now()
    taken = InvalidInput(f"expected a channel name not used in tenant {tenant!r}, found "
                         f"{name!r} taken (disable it, or choose another name)")
    try:
        with transaction.atomic(durable=True):
            if NotificationChannel.objects.filter(tenant=tenant, name=name).exists():
                raise taken
            channel = NotificationChannel.objects.create(
                tenant=tenant, name=name, kind=kind, pattern=pattern, url=url,
                secret_name=secret_name, recipients=addresses, on_queue=on_queue,
                on_approval=on_approval, stuck_after=stuck_after, is_active=True,
                updated_by=user, created_at=now, updated_at=now,
            )
            _audit(channel, user, before=None, now=now)
    except IntegrityError:  # the same name, saved by someone else meanwhile
        raise taken from None
    return channel


def set_channel_active(channel: NotificationChannel, *, user, is_active: bool
                       ) -> NotificationChannel:
    """Disable (or enable again) `channel`; audited. A disabled channel is told nothing and
    its pending batches are not delivered."""
    access.require_perm(user, "ledger.change_notificationchannel",
                        doing="change notification channels")
    access.require_tenant(user, channel.tenant)
    if not isinstance(is_active, bool):
        raise InvalidInput(f"expected is_active to be a boolean, found {is_active!r}")
    now = timezone.now()
    with transaction.atomic(durable=True):
        channel = NotificationChannel.objects.select_for_update().get(pk=channel.pk)
        if channel.is_active == is_active:
            return channel
        before = channel.as_audit_dict()
        channel.is_active = is_active
        channel.updated_by = user
        channel.updated_at = now
        channel.save(update_fields=["is_active", "updated_by", "updated_at"])
        _audit(channel, user, before=before, now=now)
    return channel


def _audit(channel: NotificationChannel, user, *, before: dict | None, now: datetime) -> None:
    NotificationChannelChange.objects.create(
        channel=channel, tenant=channel.tenant, before=before, after=channel.as_audit_dict(),
        changed_by=user, changed_by_name=user.get_username(), changed_at=now,
    )


# --- links and signatures --------------------------------------------------------------------


def desk_link(path: str) -> str:
    """The absolute URL of a desk page (`path` relative to where the desk is served)."""
    return f"{conf.DESK_URL.rstrip('/')}/{path.lstrip('/')}"


def _item_path(item_key: str) -> str:
    if item_key.startswith("conflict:"):
        return f"conflicts/{quote(item_key.removeprefix('conflict:'))}/"
    return f"operations/{quote(item_key)}/"


def signature(secret: str, timestamp: str, body: bytes) -> str:
    """`sha256=<hex>`: HMAC-SHA256 with `secret` of `<timestamp>.<body>`."""
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return f"sha256={mac.hexdigest()}"


def verify_signature(secret: str, *, timestamp: str, signature_header: str, body: bytes,
                     now: float | None = None, tolerance: int = 300) -> bool:
    """What a receiver checks: the signature matches in constant time and the timestamp is
    within `tolerance` seconds (a replayed old delivery is refused)."""
    try:
        age = abs((time.time() if now is None else now) - int(timestamp))
    except (TypeError, ValueError):
        return False
    return age <= tolerance and hmac.compare_digest(
        signature(secret, timestamp, body), signature_header or "")


# --- collect: what each channel has not been told yet ----------------------------------------


def _sql_states(states, *, excluding=frozenset()) -> str:
    """States as SQL literals (they are the State enum's own values, never input)."""
    return ", ".join(f"'{state}'" for state in states if state not in excluding)


def _candidates_sql(channel: NotificationChannel) -> str:
    """The items `channel` may be told about, as (reason, item_key, op_id, since) rows."""
    match = pattern_matches_sql("o.operation", "%(pattern)s")
    # A state the reconciler still works on is told after the grace; the others at once.
    queue_states = f"""(o.state IN ({_sql_states(QUEUE_STATES, excluding=RECONCILABLE)})
                        OR (o.state IN ({_sql_states(RECONCILABLE)})
                            AND o.state_changed_at <= %(grace)s))"""
    parts = []
    if channel.on_queue:
        parts.append(f"""SELECT 'queue' AS reason, o.operation_id AS item_key, o.id AS op_id,
                                o.state_changed_at AS since
                           FROM ledger_operation o
                          WHERE o.tenant = %(tenant)s AND {queue_states} AND {match}""")
        if channel.pattern == "*":
            parts.append("""SELECT 'queue' AS reason, 'conflict:' || c.id AS item_key,
                                   NULL::bigint AS op_id, c.created_at AS since
                              FROM ledger_factconflict c
                             WHERE c.tenant = %(tenant)s AND c.state = 'open'""")
    if channel.on_approval:
        parts.append(f"""SELECT 'approval' AS reason, o.operation_id AS item_key, o.id AS op_id,
                                r.requested_at AS since
                           FROM ledger_approvalrequest r
                           JOIN ledger_operation o ON o.id = r.operation_id
                          WHERE r.tenant = %(tenant)s AND r.status = 'pending'
                            AND o.state = '{State.PLANNED}' AND {match}""")
    if channel.stuck_after is not None:
        parts.append(f"""SELECT 'stuck' AS reason, o.operation_id AS item_key, o.id AS op_id,
                                o.state_changed_at AS since
                           FROM ledger_operation o
                          WHERE o.tenant = %(tenant)s
                            AND o.state IN ({_sql_states(QUEUE_STATES)})
                            AND o.state_changed_at <= %(stuck)s AND {match}""")
        parts.append(f"""SELECT 'stuck' AS reason, o.operation_id AS item_key, o.id AS op_id,
                                r.requested_at AS since
                           FROM ledger_approvalrequest r
                           JOIN ledger_operation o ON o.id = r.operation_id
                          WHERE r.tenant = %(tenant)s AND r.status = 'pending'
                            AND o.state = '{State.PLANNED}'
                            AND r.requested_at <= %(stuck)s AND {match}""")
        if channel.pattern == "*":
            parts.append("""SELECT 'stuck' AS reason, 'conflict:' || c.id AS item_key,
                                   NULL::bigint AS op_id, c.created_at AS since
                              FROM ledger_factconflict c
                             WHERE c.tenant = %(tenant)s AND c.state = 'open'
                               AND c.created_at <= %(stuck)s""")
    return "\nUNION ALL\n".join(parts)


class _NothingNew(Exception):
    pass


def _insert_new_items(channel: NotificationChannel, batch: NotificationBatch, candidates: str,
                      *, now: datetime) -> list[tuple]:
    """Record the channel's new items in `batch` (ON CONFLICT DO NOTHING: an item recorded
    by anyone before is not new); returns (reason, item_key, operation pk, since), oldest
    first."""
    params = {
        "channel": channel.pk, "batch": batch.pk, "tenant": channel.tenant,
        "pattern": channel.pattern, "now": now,
        "grace": now - timedelta(seconds=conf.NOTIFY_QUEUE_GRACE_SECONDS),
        "stuck": now - (channel.stuck_after or timedelta(0)), "cap": MAX_ITEMS_PER_PASS,
    }
    with connection.cursor() as cursor:
        cursor.execute(
            f"""INSERT INTO ledger_notificationsent
                    (channel_id, batch_id, reason, item_key, operation_id, waiting_since,
                     created_at)
                SELECT %(channel)s, %(batch)s, c.reason, c.item_key, c.op_id, c.since,
                       %(now)s
                  FROM ({candidates}) AS c
                 WHERE NOT EXISTS (SELECT 1 FROM ledger_notificationsent s
                                    WHERE s.channel_id = %(channel)s
                                      AND s.reason = c.reason AND s.item_key = c.item_key)
                 ORDER BY c.since, c.item_key
                 LIMIT %(cap)s
                ON CONFLICT (channel_id, reason, item_key) DO NOTHING
                RETURNING reason, item_key, operation_id, waiting_since""", params)
        return sorted(cursor.fetchall(), key=lambda r: (r[3], r[1], r[0]))


def notify_lock_name(channel_id: int) -> str:
    """The worker's lock of one channel's collecting (`ledger_worker_lock`)."""
    return f"notify:{channel_id}"


def _collect_channel(channel_id: int, *, now: datetime) -> NotificationBatch | None:
    """One channel's new items as one batch, or None. Holds the channel's collecting lock
    for the transaction (a channel another worker is collecting is left to it); the unique
    constraint on (channel, reason, item) decides what is new even without the lock.

    The lock is the worker's lock `notify:<channel id>` (`ledger_worker_lock`, a row of
    ledger_workerlock that only the reconciler's role may lock), not a row lock on the
    channel: `FOR UPDATE` needs the UPDATE privilege, which the notification loop's role
    (ledger_reconciler) is not granted on channels (they are the desk's); nor an advisory
    lock, which any login may take and hold to stall the loop."""
    with transaction.atomic(durable=True):
        with connection.cursor() as cursor:
            cursor.execute("SELECT ledger_worker_lock(%s)", [notify_lock_name(channel_id)])
            if not cursor.fetchone()[0]:
                return None
        channel = NotificationChannel.objects.filter(pk=channel_id, is_active=True).first()
        if channel is None:
            return None
        candidates = _candidates_sql(channel)
        if not candidates:
            return None
        try:
            # A savepoint: a batch with nothing new is rolled back, never deleted.
            with transaction.atomic():
                batch = NotificationBatch.objects.create(
                    channel=channel, tenant=channel.tenant, next_attempt_at=now,
                    created_at=now)
                rows = _insert_new_items(channel, batch, candidates, now=now)
                if not rows:
                    raise _NothingNew
        except _NothingNew:
            return None
        counts: dict[str, int] = {}
        for reason, *_ in rows:
            counts[reason] = counts.get(reason, 0) + 1
        batch.counts = counts
        batch.item_count = len(rows)
        batch.payload = _payload(channel, batch, rows, counts, now=now)
        batch.save(update_fields=["counts", "item_count", "payload"])
    return batch


def _payload(channel: NotificationChannel, batch: NotificationBatch, rows: list[tuple],
             counts: dict[str, int], *, now: datetime) -> dict:
    """The message: counts per reason, the first N items with their links (one query)."""
    shown = rows[: conf.NOTIFY_ITEMS_PER_MESSAGE]
    names = dict(Operation.objects.filter(pk__in=[r[2] for r in shown if r[2]])
                 .values_list("pk", "operation"))
    labels = dict(Reason.choices)
    items = [{
        "reason": reason, "reason_label": labels[reason],
        "kind": "fact_conflict" if op_pk is None else "operation",
        "id": item_key.removeprefix("conflict:"),
        "operation": names.get(op_pk, "") if op_pk else "",
        "waiting_since": since.isoformat(),
        "url": desk_link(_item_path(item_key)),
    } for reason, item_key, op_pk, since in shown]
    return {
        "type": "ledger.notification", "delivery": batch.pk,
        "channel": channel.name, "tenant": channel.tenant, "pattern": channel.pattern,
        "created_at": now.isoformat(), "total": len(rows),
        "counts": {reason: counts.get(reason, 0) for reason in Reason.values},
        "items": items, "more": len(rows) - len(items),
        "queue_url": desk_link(""), "approvals_url": desk_link("approvals/"),
    }


def collect(*, now: datetime | None = None) -> list[NotificationBatch]:
    """One batch per active channel with something new to tell; never sends anything."""
    now = now or timezone.now()
    batches = []
    for channel_id in NotificationChannel.objects.filter(is_active=True).values_list(
            "pk", flat=True):
        batch = _collect_channel(channel_id, now=now)
        if batch is not None:
            batches.append(batch)
    return batches


# --- deliver ---------------------------------------------------------------------------------


def backoff(attempts: int) -> timedelta:
    """The wait after the `attempts`-th failed attempt: doubling, capped."""
    seconds = conf.NOTIFY_BACKOFF_SECONDS * 2 ** min(max(attempts - 1, 0), 30)
    return timedelta(seconds=min(seconds, conf.NOTIFY_BACKOFF_CAP_SECONDS))


def _claim(*, now: datetime, limit: int) -> list[int]:
    lease_until = now + timedelta(seconds=conf.NOTIFY_TIMEOUT_SECONDS) + CLAIM_MARGIN
    with transaction.atomic(durable=True), connection.cursor() as cursor:
        # The pick is a materialized CTE, evaluated once (as the reconciler's claim is): as
        # `WHERE id IN (SELECT ... LIMIT n SKIP LOCKED)` a plan that rescans the subquery
        # could claim more than n batches and push the extra ones past their lease unsent.
        cursor.execute(
            """WITH picked AS MATERIALIZED (
                   SELECT b.id FROM ledger_notificationbatch b
                     JOIN ledger_notificationchannel c ON c.id = b.channel_id
                    WHERE b.status = 'pending' AND b.next_attempt_at <= %s AND c.is_active
                    ORDER BY b.next_attempt_at, b.id
                    LIMIT %s
                      FOR UPDATE OF b SKIP LOCKED)
               UPDATE ledger_notificationbatch n SET attempts = n.attempts + 1,
                      next_attempt_at = %s
                 FROM picked WHERE n.id = picked.id
            RETURNING n.id""", [now, limit, lease_until])
        return sorted(row[0] for row in cursor.fetchall())


def deliver_due(*, worker: str = "", now: datetime | None = None, limit: int = 20
                ) -> list[DeliveryAttempt]:
    """Try every batch that is due (at most `limit`), each claimed by this worker alone;
    returns the logged attempts. Never raises for a failed delivery: it is logged and
    retried."""
    attempts = []
    for _ in range(limit):
        # One batch per claim: its lease covers one send (timeout + margin), so a slow
        # receiver never lets another worker claim batches this one has not sent yet.
        at = now or timezone.now()
        claimed = _claim(now=at, limit=1)
        if not claimed:
            break
        batch = NotificationBatch.objects.select_related("channel").get(pk=claimed[0])
        started = time.monotonic()
        status_code, error = _send(batch)
        duration_ms = int((time.monotonic() - started) * 1000)
        attempts.append(_record(batch, status_code=status_code, error=error,
                                duration_ms=duration_ms, worker=worker, now=at))
    return attempts


def _send(batch: NotificationBatch) -> tuple[int | None, str]:
    """(HTTP status or None, error or "") of one attempt."""
    channel = batch.channel
    try:
        if channel.kind == Kind.EMAIL:
            subject, text = render_email(batch.payload)
            EmailMessage(subject, text, to=list(channel.recipients)).send()
            return None, ""
        return _post(channel, batch)
    except Exception as exc:  # every failure is an attempt to log, never a crash of the loop
        return None, _clean_error(f"{type(exc).__name__}: {exc}")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None  # a redirect is an answer (3xx), not a place to resend the body


def _pinned(connection_class, address: str):
    """`connection_class` (http.client's) that connects to `address` whatever its host
    resolves to now; TLS still verifies the certificate against the host's name."""

    def connect_to(host, **kwargs):
        conn = connection_class(host, **kwargs)
        conn._create_connection = lambda where, *args: socket.create_connection(
            (address, where[1]), *args)
        return conn

    return connect_to


class _Pinned:
    """A urllib handler whose connections go to `address`."""

    def __init__(self, address: str):
        super().__init__()
        self.address = address


class _PinnedHTTPHandler(_Pinned, urllib.request.HTTPHandler):
    def http_open(self, req):
        return self.do_open(_pinned(http.client.HTTPConnection, self.address), req)


class _PinnedHTTPSHandler(_Pinned, urllib.request.HTTPSHandler):
    def https_open(self, req):
        return self.do_open(_pinned(http.client.HTTPSConnection, self.address), req,
                            context=self._context)


def _opener(url: str, address: str | None) -> urllib.request.OpenerDirector:
    """No redirects; connections to `address` when given, unless a proxy from the
    environment carries the request (the proxy then resolves the name, under its rules)."""
    handlers: list = [_NoRedirect]
    parts = urlsplit(url)
    proxied = parts.scheme in urllib.request.getproxies() and not (
        urllib.request.proxy_bypass(parts.hostname or ""))
    if address is not None and not proxied:
        handlers += [_PinnedHTTPHandler(address), _PinnedHTTPSHandler(address)]
    return urllib.request.build_opener(*handlers)


def _post(channel: NotificationChannel, batch: NotificationBatch) -> tuple[int | None, str]:
    try:
        address = check_destination(channel.url)  # again: a name may resolve elsewhere now
    except InvalidInput as refused:
        return None, str(refused)
    secret = conf.WEBHOOK_SECRETS.get(channel.secret_name)
    if not secret:
        return None, (f"expected a secret named {channel.secret_name} in "
                      f"LEDGER_WEBHOOK_SECRETS (environment LEDGER_WEBHOOK_SECRET_"
                      f"{channel.secret_name}), found none")
    body = json.dumps(batch.payload, sort_keys=True, separators=(",", ":")).encode()
    timestamp = str(int(time.time()))
    request = urllib.request.Request(channel.url, data=body, method="POST", headers={
        "Content-Type": "application/json", "User-Agent": "agent-ledger-notify",
        TIMESTAMP_HEADER: timestamp, SIGNATURE_HEADER: signature(secret, timestamp, body),
        DELIVERY_HEADER: str(batch.pk), "X-Ledger-Attempt": str(batch.attempts),
    })
    opener = _opener(channel.url, address)
    try:
        with opener.open(request, timeout=conf.NOTIFY_TIMEOUT_SECONDS) as response:
            code = response.status
    except urllib.error.HTTPError as exc:
        answer = exc.read(200).decode("utf-8", "replace")
        return exc.code, _clean_error(f"expected a 2xx answer, found {exc.code}: {answer}")
    if not 200 <= code < 300:
        return code, f"expected a 2xx answer, found {code}"
    return code, ""


def _clean_error(text: str) -> str:
    """An error as stored and shown: credentials scrubbed, the secret never, bounded."""
    text = scrub_text(text)
    for secret in conf.WEBHOOK_SECRETS.values():
        text = text.replace(secret, REDACTED)
    return text.replace("\x00", "")[:MAX_ERROR]


def _record(batch: NotificationBatch, *, status_code: int | None, error: str,
            duration_ms: int, worker: str, now: datetime) -> DeliveryAttempt:
    is_ok = not error
    with transaction.atomic(durable=True):
        attempt = DeliveryAttempt.objects.create(
            batch=batch, channel_id=batch.channel_id, tenant=batch.tenant,
            attempt=batch.attempts, is_ok=is_ok, status_code=status_code, error=error,
            duration_ms=duration_ms, worker=worker[:200], started_at=now,
        )
        if is_ok:
            changes = {"status": NotificationBatch.Status.DELIVERED, "delivered_at": now,
                       "last_error": ""}
        elif batch.attempts >= conf.NOTIFY_MAX_ATTEMPTS:
            changes = {"status": NotificationBatch.Status.FAILED, "last_error": error}
        else:
            changes = {"next_attempt_at": now + backoff(batch.attempts), "last_error": error}
        NotificationBatch.objects.filter(pk=batch.pk, status="pending").update(**changes)
    return attempt


def render_email(payload: dict) -> tuple[str, str]:
    """(subject, plain text) of a batch's message."""
    total, tenant = payload["total"], payload["tenant"]
    subject = (f"[Agent Ledger] {total} item{'s' if total != 1 else ''} need"
               f"{'' if total != 1 else 's'} a person ({tenant}, {payload['pattern']})")
    lines = [f"Channel {payload['channel']} of tenant {tenant}:"]
    labels = dict(Reason.choices)
    lines += [f"  {labels[reason]}: {n}" for reason, n in payload["counts"].items() if n]
    lines.append("")
    for item in payload["items"]:
        what = item["operation"] or item["kind"].replace("_", " ")
        lines.append(f"- {what} {item['id']} ({item['reason_label'].lower()}, waiting since "
                     f"{item['waiting_since']}): {item['url']}")
    if payload["more"]:
        lines.append(f"... and {payload['more']} more: {payload['queue_url']}")
    return subject, "\n".join(lines) + "\n"


def run_once(*, worker: str = "", now: datetime | None = None) -> tuple[int, int]:
    """One pass: collect, then deliver what is due. Returns (batches made, attempts)."""
    now = now or timezone.now()
    batches = collect(now=now)
    return len(batches), len(deliver_due(worker=worker, now=now))


# --- metrics ---------------------------------------------------------------------------------


@metrics.register
def notification_metrics(now: datetime) -> Iterable[Metric]:
    with connection.cursor() as cursor:
        cursor.execute(
            """SELECT (SELECT count(*) FROM ledger_deliveryattempt WHERE NOT is_ok),
                      (SELECT count(*) FROM ledger_notificationbatch WHERE status = 'pending'),
                      (SELECT count(*) FROM ledger_notificationbatch WHERE status = 'failed'),
                      (SELECT min(created_at) FROM ledger_notificationbatch
                        WHERE status = 'pending')""")
        failed, pending, gave_up, oldest = cursor.fetchone()
    yield CounterMetricFamily(
        "ledger_notification_delivery_failures",
        "Notification delivery attempts that failed (every channel, since the start)",
        value=failed)
    undelivered = GaugeMetricFamily(
        "ledger_notification_batches_undelivered",
        "Notification batches not delivered: pending (will be retried) or failed (given up)",
        labels=["status"])
    undelivered.add_metric(["pending"], pending)
    undelivered.add_metric(["failed"], gave_up)
    yield undelivered
    yield GaugeMetricFamily(
        "ledger_notification_oldest_pending_seconds",
        "Age of the oldest notification batch not delivered yet (0 when none)",
        value=max(0.0, (now - oldest).total_seconds()) if oldest else 0.0)


def secret_names() -> list[str]:
    """The configured secret names (never the secrets), for the desk's form."""
    return sorted(conf.WEBHOOK_SECRETS)
