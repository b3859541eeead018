"""The one gate for arguments: every public entry point checks what it was given here,
before any query.

Each check raises InvalidInput (a ValueError) saying what was expected and what was found,
and returns the value it accepted, so a caller reads `name = check_text(name, ...)`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from ledger.errors import InvalidInput

# Operation names: `articles.create`, `mail:send`, `crm/contacts.update`.
_OPERATION_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:/-]*$")
# Retention patterns: operation-name characters and the wildcards * and ?.
_OPERATION_PATTERN = re.compile(r"^[A-Za-z0-9_.:/*?-]+$")


def check_text(value: Any, name: str, max_length: int | None = None) -> str:
    """A string with something besides whitespace, of at most `max_length` characters."""
    if not isinstance(value, str) or not value.strip():
        raise InvalidInput(f"expected {name} to be a non-empty string, found {value!r}")
    if max_length is not None and len(value) > max_length:
        raise InvalidInput(
            f"expected {name} of at most {max_length} characters, found {len(value)}"
        )
    return value


def check_string(value: Any, name: str, max_length: int | None = None) -> str:
    """Any string (empty too) of at most `max_length` characters."""
    if not isinstance(value, str):
        raise InvalidInput(f"expected {name} to be a string, found {type(value).__name__}")
    if max_length is not None and len(value) > max_length:
        raise InvalidInput(
            f"expected {name} of at most {max_length} characters, found {len(value)}"
        )
    return value


def check_reason(reason: Any) -> str:
    """A person's reason for a decision: non-empty; returned without surrounding space."""
    if not isinstance(reason, str) or not reason.strip():
        raise InvalidInput(f"expected a non-empty reason for the decision, found {reason!r}")
    return reason.strip()


def check_operation_name(value: Any) -> str:
    check_text(value, "operation", 200)
    if not _OPERATION_NAME.match(value):
        raise InvalidInput(
            "expected operation to be a name like 'articles.create' (letters, digits, "
            f"'_', '.', ':', '/', '-'), found {value!r}"
        )
    return value


def check_operation_pattern(value: Any) -> str:
    """An operation name that may hold the wildcards * and ? (retention policies)."""
    if not isinstance(value, str) or not _OPERATION_PATTERN.match(value) or len(value) > 200:
        raise InvalidInput(
            "expected a pattern of operation-name characters (letters, digits, _ . : / -) and "
            f"wildcards * ?, at most 200 long, found {value!r}"
        )
    return value


def check_tenant_or_every(value: Any) -> str:
    """A tenant name, or '' for every tenant (retention policies)."""
    if not isinstance(value, str) or len(value) > 100 or value != value.strip():
        raise InvalidInput(f"expected tenant to be a tenant name or '' (every tenant), "
                           f"found {value!r}")
    return value


def check_choice(value: Any, name: str, choices: Iterable[str]) -> str:
    choices = list(choices)
    if value not in choices:
        raise InvalidInput(f"expected {name} one of {choices}, found {value!r}")
    return value


def check_whole_number(value: Any, *, low: int, high: int | None = None, expected: str) -> int:
    """An int (never a bool) from `low` to `high`; the refusal reads "expected <expected>,
    found <value>"."""
    if (isinstance(value, bool) or not isinstance(value, int) or value < low
            or (high is not None and value > high)):
        raise InvalidInput(f"expected {expected}, found {value!r}")
    return value


def check_aware(value: Any, name: str) -> datetime | None:
    """None, or a timezone-aware datetime."""
    if value is not None and (not isinstance(value, datetime) or timezone.is_naive(value)):
        raise InvalidInput(f"expected {name} to be a timezone-aware datetime, found {value!r}")
    return value


def check_positive_duration(value: Any, name: str) -> timedelta:
    if not isinstance(value, timedelta) or value <= timedelta(0):
        raise InvalidInput(f"expected {name} to be a positive timedelta, found {value!r}")
    return value


def check_duration(value: Any, name: str, *, high: timedelta | None = None) -> timedelta:
    """A timedelta from 0 to `high` (no upper bound when None)."""
    if not isinstance(value, timedelta) or value < timedelta(0):
        raise InvalidInput(f"expected {name} to be a timedelta {_range(high)}, found {value!r}")
    if high is not None and value > high:
        raise InvalidInput(f"expected {name} to be a timedelta {_range(high)}, found {value!r}")
    return value


def _range(high: timedelta | None) -> str:
    return ">= 0" if high is None else f"from 0 to {high}"


def check_names(values: Iterable[str], name: str, max_length: int) -> list[str]:
    """A list of distinct non-empty strings (a lone string is refused, not split)."""
    if isinstance(values, str):
        raise InvalidInput(f"expected {name} to be a list of names, found the string {values!r}")
    result = list(values)
    for value in result:
        check_text(value, f"each of {name}", max_length)
    if len(set(result)) != len(result):
        raise InvalidInput(f"expected {name} without repeats, found {result!r}")
    return result


def check_paths(paths: Iterable[str], name: str) -> list[str]:
    """A list of dotted paths into a JSON object, like 'body.card'."""
    if isinstance(paths, str):
        raise InvalidInput(f"expected {name} to be a list of dotted paths, found a string")
    result = list(paths)
    for path in result:
        if not isinstance(path, str) or not path or path.startswith(".") or ".." in path:
            raise InvalidInput(
                f"expected each of {name} to be a dotted path like 'body.card', found {path!r}"
            )
    return result


def parse_json_object(text: Any, name: str, max_bytes: int) -> dict[str, Any]:
    """A JSON object typed by a person (the desk's edited intent): parsed, or refused
    saying where it stops being JSON. Its content is checked by the caller's own gate
    (`canonical.check_json`, limits, secrets)."""
    import json

    check_text(text, name)
    size = len(text.encode("utf-8"))
    if size > max_bytes:
        raise InvalidInput(f"expected {name} of at most {max_bytes:,} bytes, found {size:,}")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"expected {name} to be JSON, found an error at line {exc.lineno} "
                           f"column {exc.colno}: {exc.msg}") from None
    except RecursionError:
        raise InvalidInput(f"expected {name} nested less deeply, found it too deep") from None
    if not isinstance(value, dict):
        raise InvalidInput(f"expected {name} to be a JSON object ({{...}}), found "
                           f"{type(value).__name__}")
    return value
