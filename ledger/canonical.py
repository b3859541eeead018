"""Canonical JSON, redaction of secrets, and intent fingerprints.

Redaction happens before anything is stored: a value under a key that names a secret (at
any depth), or under a path the caller lists, is replaced by `REDACTED`. The fingerprint is
computed from the redacted intent, so it can never depend on a secret.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from ledger.errors import InvalidInput

REDACTED = "[redacted]"

# A key is secret when one of its words is one of these (case and separators ignored):
# "X-Api-Key", "apiKey", "refresh_token", "Set-Cookie", "client_secret", "DB_PASSWORD" ...
_SECRET_WORDS = frozenset(
    {
        "authorization",
        "auth",
        "bearer",
        "cookie",
        "cookies",
        "credential",
        "credentials",
        "passphrase",
        "passwd",
        "password",
        "pwd",
        "secret",
        "token",
        "apikey",
        "signature",
        "session",
        "sessionid",
        "csrftoken",
    }
)
_SECRET_PAIRS = frozenset(
    {("api", "key"), ("private", "key"), ("access", "key"), ("secret", "key"), ("signing", "key")}
)
_WORD_SPLIT = re.compile(r"[^a-z0-9]+")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


def is_secret_key(key: str) -> bool:
    words = [w for w in _WORD_SPLIT.split(_CAMEL.sub("_", key).lower()) if w]
    if any(w in _SECRET_WORDS for w in words):
        return True
    return any(pair in _SECRET_PAIRS for pair in zip(words, words[1:], strict=False))


def canonical_json(value: Any) -> str:
    """Sorted keys, no insignificant white space, UTF-8, no NaN or Infinity."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)


_SECRET_IN_TEXT = re.compile(
    r"(?i)(\b(?:authorization|password|passwd|secret|token|api[_-]?key|access[_-]?key|cookie)\b"
    r"[\"']?\s*[:=]\s*[\"']?(?:(?:bearer|basic|token)\s+)?|\bbearer\s+|\bbasic\s+)"
    r"([^\s\"',;&]+)"
)


def scrub_text(text: str) -> str:
    """Free text (error details, reasons) with credentials after `Bearer`, `password=`... masked."""
    return _SECRET_IN_TEXT.sub(lambda m: m.group(1) + REDACTED, text)


def check_json(value: Any, *, what: str = "intent", path: str = "") -> None:
    """Raise InvalidInput unless `value` is plain JSON (dict/list/str/int/float/bool/None)."""
    here = path or what
    if value is None or isinstance(value, (str, bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidInput(
                f"expected {here} to be a finite JSON number, found {value!r} "
                "(NaN and Infinity are not JSON)"
            )
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidInput(
                    f"expected every key in {here} to be a string, found {type(key).__name__} "
                    f"{key!r}"
                )
            check_json(item, what=what, path=f"{here}.{key}")
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            check_json(item, what=what, path=f"{here}[{index}]")
        return
    raise InvalidInput(
        f"expected {here} to hold only JSON values (object, array, string, number, true, "
        f"false, null), found {type(value).__name__} {_short_repr(value)}"
    )


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def redact(value: Any, paths: Iterable[str] = ()) -> Any:
    """A copy of `value` with secret-named keys and the dotted `paths` replaced by REDACTED.

    A path walks into every element of a list it meets: "items.card" redacts `card` in each
    element of `items`.
    """
    split_paths = [tuple(p.split(".")) for p in paths if p]
    return _redact(value, split_paths)


def _redact(value: Any, paths: list[tuple[str, ...]]) -> Any:
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if is_secret_key(key) or (key,) in paths:
                out[key] = REDACTED
                continue
            deeper = [p[1:] for p in paths if len(p) > 1 and p[0] == key]
            out[key] = _redact(item, deeper)
        return out
    if isinstance(value, (list, tuple)):
        return [_redact(item, paths) for item in value]
    return value


def select_fields(value: Mapping[str, Any], fields: Iterable[str]) -> dict[str, Any]:
    """The dotted `fields` of `value` that exist, keyed by their path."""
    selected: dict[str, Any] = {}
    for field in fields:
        current: Any = value
        for part in field.split("."):
            if isinstance(current, Mapping) and part in current:
                current = current[part]
            else:
                break
        else:
            selected[field] = current
    return selected


def fingerprint(redacted_intent: Mapping[str, Any], fields: Iterable[str] | None = None) -> str:
    """`sha256:<hex>` of the canonical JSON of the (allow-listed) redacted intent."""
    material = redacted_intent if fields is None else select_fields(redacted_intent, fields)
    digest = hashlib.sha256(canonical_json(material).encode("utf-8")).hexdigest()
    return f"sha256:{digest}"
