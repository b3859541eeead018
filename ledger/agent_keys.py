"""Agent keys: how an agent outside this process proves who it is.

Admins create a key per agent (`create`) and revoke it (`revoke`); both are audited in
`AgentKeyChange`. The secret is shown once, at creation: only its SHA-256 is stored, so
neither the database nor a log can give it back. A secret is 32 random bytes, so one
unsalted hash is enough (nothing to guess from); the lookup is by that hash and the
comparison constant-time. A key is scoped to its tenants and acts as a principal wherever
the ledger asks who is acting (`ledger.access.tenants_for`); its name is the actor recorded
on every event it causes.

A key verified a moment ago is believed again without asking the database, for at most
`LEDGER_AGENT_KEY_CACHE_SECONDS` (0, the default: never) and for at most 1,024 keys per process,
looked up by the secret's SHA-256 (the secret itself is never kept). Every read that asks
the database anyway (a request naming an operation reads its key in the same statement)
refreshes the entry, or drops it when the key is revoked; `revoke` drops it at once in the
process that revokes. Elsewhere a revoked key is refused within that many seconds.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable

from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from ledger import access, conf, rows
from ledger.errors import InvalidInput
from ledger.inputs import check_identifier, check_names
from ledger.models import AgentKey, AgentKeyChange, Operation
from ledger.prepared import prepared_cursor
from ledger.selectors.operations import remember_read

# Recognisable in a leaked config file or a secret scanner's rules.
SECRET_PREFIX = "alk_"
_SECRET = re.compile(r"alk_[A-Za-z0-9_-]{43}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,99}")


def create(name: str, *, tenants: Iterable[str], user) -> tuple[AgentKey, str]:
    """A new key for the agent `name`, seeing `tenants`; returns (key, secret).

    The secret is returned only here, never stored. Needs `ledger.add_agentkey` (the admin
    role). A name already used by a key, even a revoked one, raises InvalidInput: a name
    names one agent for the life of the audit trail.
    """
    access.require_perm(user, "ledger.add_agentkey", doing="create agent keys")
    _check_name(name)
    tenants = check_names(tenants, "tenants", 100)
    if not tenants:
        raise InvalidInput("expected at least one tenant for the key, found none")
    for tenant in tenants:  # nobody hands an agent a tenant they cannot see themselves
        access.require_tenant(user, tenant)
    secret = SECRET_PREFIX + secrets.token_urlsafe(32)
    now = timezone.now()
    try:
        with transaction.atomic(durable=True):
            key = AgentKey.objects.create(
                name=name, prefix=secret[:8], secret_hash=_hash(secret), tenants=tenants,
                created_by_name=user.get_username(), created_at=now,
            )
            _audit(key, AgentKeyChange.Action.CREATED, user=user, now=now)
    except IntegrityError:
        raise InvalidInput(
            f"expected a new agent name, found a key named {name!r} already "
            "(revoked keys keep their names)"
        ) from None
    return key, secret


def revoke(name: str, *, user) -> AgentKey:
    """Revoke the key of agent `name`: it authenticates nothing from now on. Revoking a
    revoked key returns it unchanged. Needs `ledger.change_agentkey` (the admin role)."""
    access.require_perm(user, "ledger.change_agentkey", doing="revoke agent keys")
    _check_name(name)
    now = timezone.now()
    with transaction.atomic(durable=True):
        key = AgentKey.objects.select_for_update().filter(name=name).first()
        if key is None:
            raise InvalidInput(f"expected an agent key named {name!r}, found none")
        for tenant in key.tenants:  # a key of a tenant one cannot see stays out of reach
            access.require_tenant(user, tenant)
        if key.revoked_at is not None:
            return key
        key.revoked_at, key.revoked_by_name = now, user.get_username()
        key.save(update_fields=["revoked_at", "revoked_by_name"])
        _audit(key, AgentKeyChange.Action.REVOKED, user=user, now=now)
    _verified.forget(key.pk)
    return key


def authenticate(secret: str, *, operation_id: str | None = None) -> AgentKey | None:
    """The live key whose secret this is, or None (malformed, unknown or revoked).

    With `operation_id` (the id a request's path names), the same statement also reads
    that operation through the key's tenants (`authenticate_with_operation`) and leaves it
    to the request's `selectors.access_operation` of this key and id, which answers from it
    instead of asking again: one round trip less on every request that acts on one
    operation. An id the input gate refuses is not read (access_operation refuses it).
    """
    if operation_id is not None and _well_formed_operation_id(operation_id):
        key, found = authenticate_with_operation(secret, operation_id)
        if key is not None:
            remember_read(key, operation_id, found)
        return key
    if not isinstance(secret, str) or not _SECRET.fullmatch(secret):
        return None
    digest = _hash(secret)
    key = _verified.get(digest)
    if key is not None:
        return key
    # On every request of every agent: prepared, without the ORM's query compilation.
    with prepared_cursor() as cursor:
        cursor.execute(_AUTHENTICATE, [digest])
        row = cursor.fetchone()
    key = None if row is None else _live_key(row, digest)
    _verified.put(digest, key)
    return key


def authenticate_with_operation(
    secret: str, operation_id: str
) -> tuple[AgentKey | None, Operation | None]:
    """(the live key whose secret this is, or None; the operation `operation_id` if one of
    that key's tenants holds it, or None), in one statement.

    What a request acting on one operation needs before anything else, in one round trip
    instead of two: the key is read exactly as `authenticate` reads it (so a key revoked a
    moment ago authenticates nothing), and the operation only through it. Another tenant's
    operation and a missing one are both None. `operation_id` must already have passed the
    input gate (`inputs.check_identifier`); the caller raises NotFound for a None.
    """
    if not isinstance(secret, str) or not _SECRET.fullmatch(secret):
        return None, None
    digest = _hash(secret)
    with prepared_cursor() as cursor:
        cursor.execute(_AUTHENTICATE_WITH_OPERATION, [operation_id, digest])
        row = cursor.fetchone()
    key = None if row is None else _live_key(row[:len(_KEY_FIELDS)], digest)
    _verified.put(digest, key)
    if key is None:
        return None, None
    # A LEFT JOIN that matched nothing: every operation column NULL, its id first.
    found = row[len(_KEY_FIELDS):]
    return key, (None if found[0] is None else rows.operation_from_row(found))


def _well_formed_operation_id(operation_id) -> bool:
    if not isinstance(operation_id, str) or not 0 < len(operation_id) <= 40:
        return False
    try:
        check_identifier(operation_id, "operation_id", 40)
    except InvalidInput:
        return False
    return True


def _live_key(row, digest: str) -> AgentKey | None:
    values = [field.from_db_value(value, None, connection) if hasattr(field, "from_db_value")
              else value for field, value in zip(_KEY_FIELDS, row, strict=True)]
    key = AgentKey.from_db(connection.alias, _KEY_ATTNAMES, values)
    if not hmac.compare_digest(key.secret_hash, digest):
        return None
    return key


_KEY_FIELDS = AgentKey._meta.concrete_fields
_KEY_ATTNAMES = [f.attname for f in _KEY_FIELDS]


class VerifiedKeys:
    """Live keys verified in the last `conf.AGENT_KEY_CACHE_SECONDS`, by their secret's
    SHA-256, at most `size` of them (the least recently used go first). Each `get` returns
    a new AgentKey, so what one request leaves on its key (`remember_read`) is never seen
    by another. Thread-safe: a web worker serves requests on several threads."""

    def __init__(self, size: int = 1024, clock=time.monotonic):
        self.size, self.clock = size, clock
        self._entries: OrderedDict[str, tuple[float, list]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, digest: str) -> AgentKey | None:
        now = self.clock()
        with self._lock:
            entry = self._entries.get(digest)
            if entry is None:
                return None
            if entry[0] <= now:
                del self._entries[digest]
                return None
            self._entries.move_to_end(digest)
            values = entry[1]
        return AgentKey.from_db(connection.alias, _KEY_ATTNAMES, list(values))

    def put(self, digest: str, key: AgentKey | None) -> None:
        """Remember `key` as just read for `digest`; None (unknown or revoked now) forgets
        whatever was remembered for it."""
        seconds = conf.AGENT_KEY_CACHE_SECONDS
        with self._lock:
            if key is None or seconds <= 0:
                self._entries.pop(digest, None)
                return
            values = [getattr(key, name) for name in _KEY_ATTNAMES]
            self._entries[digest] = (self.clock() + seconds, values)
            self._entries.move_to_end(digest)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def forget(self, pk) -> None:
        """Forget the key whose primary key is `pk` (revoked in this process)."""
        index = _KEY_ATTNAMES.index(AgentKey._meta.pk.attname)
        with self._lock:
            for digest in [d for d, (_, values) in self._entries.items()
                           if values[index] == pk]:
                del self._entries[digest]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


_verified = VerifiedKeys()


def _key_columns(alias: str = "") -> str:
    prefix = f"{alias}." if alias else ""
    return ", ".join(prefix + connection.ops.quote_name(f.column) for f in _KEY_FIELDS)


_AUTHENTICATE = (
    f"SELECT {_key_columns()} FROM {AgentKey._meta.db_table}"
    " WHERE secret_hash = %s AND revoked_at IS NULL"
)
# The key's tenants are a JSON array of names: `?` asks whether the operation's tenant is
# one of its elements, the same test as `access.can_see(key, tenant)`.
_AUTHENTICATE_WITH_OPERATION = (
    f"SELECT {_key_columns('k')}, {rows.operation_columns('o')}"
    f" FROM {AgentKey._meta.db_table} k"
    f" LEFT JOIN {Operation._meta.db_table} o"
    " ON o.operation_id = %s AND k.tenants ? o.tenant"
    " WHERE k.secret_hash = %s AND k.revoked_at IS NULL"
)


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _check_name(name) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidInput(
            "expected an agent name of letters, digits, '_', '.', ':' or '-' (at most 100, "
            f"starting with a letter or digit), found {ascii(name)}"
        )


def _audit(key: AgentKey, action: str, *, user, now) -> AgentKeyChange:
    return AgentKeyChange.objects.create(
        key=key, key_name=key.name, action=action, tenants=key.tenants,
        changed_by=user if getattr(user, "pk", None) else None,
        changed_by_name=user.get_username(), changed_at=now,
    )
