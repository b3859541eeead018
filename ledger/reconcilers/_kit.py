"""What the kits share: URL templates, JSON paths, one GET, evidence of a bounded size."""

from __future__ import annotations

import os
import string
import threading
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import quote

from ledger import reconcile
from ledger.canonical import canonical_json, scrub_text
from ledger.errors import InvalidInput
from ledger.models import Operation

# The operation fields a URL template may name; each is percent-encoded, except `target`,
# which is a URL itself ("{target}/by-key/{idempotency_key}"). `account`: the provider
# account the call acted as, so the reader reads as it ("{target}?account={account}"; a
# `headers` function gets the operation and its `account` too).
TEMPLATE_FIELDS = ("idempotency_key", "external_id", "operation_id", "operation", "tenant",
                   "target", "account")
# Engine tuning a kit passes on to its Reconciler class.
TUNING = ("grace_period", "backoff_initial", "backoff_max", "lease_ttl", "max_failures")
MAX_BODY_CHARS = 20_000

_clients: dict[int, Any] = {}
_clients_lock = threading.Lock()


def template_fields(template: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(template) if name}


def check_template(template: Any, what: str, extra: tuple[str, ...] = ()) -> None:
    if callable(template):
        return
    if not isinstance(template, str) or not template.strip():
        raise InvalidInput(f"expected {what} to be a URL template or a callable, "
                           f"found {template!r}")
    try:
        unknown = template_fields(template) - set(TEMPLATE_FIELDS) - set(extra)
    except ValueError as exc:
        raise InvalidInput(f"expected {what} to be a URL template, found {template!r}: "
                           f"{exc}") from None
    if unknown:
        raise InvalidInput(
            f"expected {what} to name only {sorted((*TEMPLATE_FIELDS, *extra))} in braces, "
            f"found {sorted(unknown)} in {template!r}"
        )


def fill(template: str | Callable[[Operation], str], op: Operation, **extra: Any) -> str:
    """The URL for `op`: a callable's answer, or the template with the operation's fields."""
    if callable(template):
        return template(op)
    values = {name: quote(str(getattr(op, name) or ""), safe="") for name in TEMPLATE_FIELDS}
    values["target"] = op.target
    values.update({name: quote(str(value), safe="") for name, value in extra.items()})
    return template.format_map(values)


def pluck(value: Any, path: str) -> Any:
    """`value` at the dotted `path` ("article.id", "items.0.id"); "" is the value itself.

    KeyError naming the path when it does not exist.
    """
    here = value
    for part in path.split(".") if path else ():
        if isinstance(here, Mapping) and part in here:
            here = here[part]
        elif isinstance(here, list) and part.isdigit() and int(part) < len(here):
            here = here[int(part)]
        else:
            raise KeyError(f"expected {path!r} in the answer, found no {part!r} there")
    return here


def extract(spec: str | Callable[[Any], Any], value: Any) -> Any:
    return spec(value) if callable(spec) else pluck(value, spec)


def check_extractor(spec: Any, what: str) -> None:
    if not (callable(spec) or isinstance(spec, str)):
        raise InvalidInput(f"expected {what} to be a dotted JSON path or a callable, "
                           f"found {spec!r}")


def get(url: str, *, headers: Mapping[str, str] | Callable | None, op: Operation,
        timeout: float, client: Any = None) -> tuple[int, Any]:
    """GET `url`; (status, JSON body, or the text when it is not JSON). Transport errors
    propagate: the engine records them as reconciler errors and tries again later."""
    import httpx  # a dependency of the mcp SDK; imported here so that `ledger` loads without

    sent = headers(op) if callable(headers) else dict(headers or {})
    if client is None:
        with _clients_lock:
            client = _clients.get(os.getpid())
            if client is None:  # one per process: a new client costs a TLS context each time
                client = _clients[os.getpid()] = httpx.Client(follow_redirects=False)
    response = client.get(url, headers=sent, timeout=timeout)
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, response.text


def observed_body(body: Any) -> Any:
    """The body as evidence: as it is when small, else its first characters."""
    text = body if isinstance(body, str) else canonical_json(body)
    if len(text) <= MAX_BODY_CHARS:
        return body
    return {"excerpt": text[:2000], "characters": len(text)}


def shown_url(url: str) -> str:
    return scrub_text(url)


def not_visible_yet(op: Operation, body: Any, consistent_as_of: Any) -> str:
    """Why an absence in `body` may not reflect `op`'s request yet ("" when it does).

    `consistent_as_of`: a path or callable giving the time up to which the service's reads
    are complete (an ISO string or an aware datetime); None when the service reads its own
    writes at once.
    """
    if consistent_as_of is None:
        return ""
    raw = extract(consistent_as_of, body)
    horizon = raw if isinstance(raw, datetime) else datetime.fromisoformat(str(raw))
    if op.submitted_at is None or horizon < op.submitted_at:
        return (f"the service's reads are complete up to {horizon.isoformat()}, before the "
                f"submission at {op.submitted_at.isoformat() if op.submitted_at else 'unknown'}")
    return ""


def optional_key(spec: str | Callable[[Any], Any] | None, value: Any) -> str | None:
    """The idempotency key `value` shows at `spec`, or None when it shows none."""
    if spec is None:
        return None
    try:
        found = extract(spec, value)
    except (KeyError, TypeError, IndexError, AttributeError):
        return None
    if found in (None, ""):
        return None
    return found if isinstance(found, str) else str(found)


def check_keys(keys: Any) -> bool:
    if not isinstance(keys, bool):
        raise InvalidInput(f"expected keys to be True (the service records idempotency "
                           f"keys) or False (it has none), found {keys!r}")
    return keys


def control_attrs(trusted_absence: Any, canary: Any) -> dict[str, Any]:
    """The positive-control declarations of a kit (`reconcile.check_absence`), checked."""
    if not isinstance(trusted_absence, str):
        raise InvalidInput(f"expected trusted_absence to be the reason, in words, why this "
                           f"reader's not-found is proof with no control yet (or \"\"), "
                           f"found {trusted_absence!r}")
    if canary is not None and not callable(canary):
        if not isinstance(canary, Mapping) or not (canary.get("idempotency_key")
                                                   or canary.get("external_id")):
            raise InvalidInput(f"expected canary to be a dict naming an idempotency_key or an "
                               f"external_id (and the intent to match on), or a function of "
                               f"the operation, found {canary!r}")
        unknown = set(canary) - {"idempotency_key", "external_id", "intent", "target"}
        if unknown:
            raise InvalidInput(f"expected canary to name only idempotency_key, external_id, "
                               f"intent and target, found {sorted(unknown)}")
        canary = dict(canary)
    return {"trusted_absence": trusted_absence.strip(),
            "canary": staticmethod(canary) if callable(canary) else canary}


def build(base: type[reconcile.Reconciler], operation: str | None, name: str,
          attrs: dict[str, Any], tuning: dict[str, Any]) -> type[reconcile.Reconciler]:
    unknown = set(tuning) - set(TUNING)
    if unknown:
        raise InvalidInput(f"expected tuning among {list(TUNING)}, found {sorted(unknown)}")
    for key in ("grace_period", "backoff_initial", "backoff_max", "lease_ttl"):
        if key in tuning and not isinstance(tuning[key], timedelta):
            raise InvalidInput(f"expected {key} to be a timedelta, found {tuning[key]!r}")
    cls = type(base.__name__, (base,), {"name": name, **attrs, **tuning})
    cls.__module__ = base.__module__
    if operation is not None:
        reconcile.register(operation)(cls)
    return cls
