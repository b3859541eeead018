"""The one gate for arguments: every public entry point checks what it was given here,
before any query.

Each check raises InvalidInput (a ValueError) saying what was expected and what was found,
and returns the value it accepted, so a caller reads `name = check_text(name, ...)`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from ledger import conf
from ledger.errors import InvalidInput

# Operation names: `articles.create`, `mail:send`, `crm/contacts.update`.
_OPERATION_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:/-]*")
# Retention patterns: operation-name characters and the wildcards * and ?.
_OPERATION_PATTERN = re.compile(r"[A-Za-z0-9_.:/*?-]+")
# What PostgreSQL text cannot hold: NUL, and UTF-16 halves without their pair (a JSON
# escape can carry them, UTF-8 cannot).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
# What an identifier may not hold besides: every other control character (C0, DEL, C1),
# the line and paragraph separators.
_NOT_IN_IDENTIFIER = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")
# Longest integer a JSON value may hold, in digits: far beyond any count or id, far below
# Python's own limit on printing digits (4,300), which would otherwise fail naming nothing.
MAX_JSON_INT_DIGITS = 100
_JSON_INT_LIMIT = 10**MAX_JSON_INT_DIGITS
# The marker ending a text cut to its size.
CUT_MARKER = " [... cut: {cut:,} more characters]"


def _describe(value: str) -> str:
    """`value` as a refusal shows it: escaped, and no longer than 80 characters."""
    text = ascii(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _storable(value: str) -> bool:
    return _UNSTORABLE.search(value) is None


def _unstorable(value: str, name: str) -> None:
    found = _UNSTORABLE.search(value)
    if found:
        what = "a NUL" if found[0] == "\x00" else f"an unpaired surrogate {ascii(found[0])}"
        raise InvalidInput(
            f"expected {name} to be text PostgreSQL can store (no NUL, no unpaired "
            f"surrogate), found {what} at character {found.start()} of {_describe(value)}"
        )


def check_text(value: Any, name: str, max_length: int | None = None) -> str:
    """A string with something besides whitespace, of at most `max_length` characters,
    without NUL or unpaired surrogates (which the database cannot store)."""
    if not isinstance(value, str) or not value.strip():
        raise InvalidInput(f"expected {name} to be a non-empty string, found {value!r}")
    if max_length is not None and len(value) > max_length:
        raise InvalidInput(
            f"expected {name} of at most {max_length} characters, found {len(value)}"
        )
    _unstorable(value, name)
    return value


def check_string(value: Any, name: str, max_length: int | None = None) -> str:
    """Any string (empty too) of at most `max_length` characters, storable as for
    `check_text`."""
    if not isinstance(value, str):
        raise InvalidInput(f"expected {name} to be a string, found {type(value).__name__}")
    if max_length is not None and len(value) > max_length:
        raise InvalidInput(
            f"expected {name} of at most {max_length} characters, found {len(value)}"
        )
    _unstorable(value, name)
    return value


def check_identifier(value: Any, name: str, max_length: int | None = None) -> str:
    """A name the ledger looks things up by (tenant, key, run and step ids, subjects,
    owners, actors...): non-empty, at most `max_length` characters, no control characters
    (newlines and NUL included), no unpaired surrogates, no surrounding whitespace. Two
    names that print alike must be the same name."""
    check_text(value, name, max_length)
    found = _NOT_IN_IDENTIFIER.search(value)
    if found:
        raise InvalidInput(
            f"expected {name} to be a name without control characters or unpaired "
            f"surrogates, found {ascii(found[0])} at character {found.start()} of "
            f"{_describe(value)}"
        )
    if value != value.strip():
        raise InvalidInput(
            f"expected {name} without surrounding whitespace, found {_describe(value)}"
        )
    return value


def check_optional_identifier(value: Any, name: str, max_length: int | None = None):
    """None, or an identifier as `check_identifier` takes it."""
    return None if value is None else check_identifier(value, name, max_length)


def storable_text(value: Any, name: str, max_length: int = 4000) -> str:
    """Text from the outside world (exception messages, details, reasons, observations),
    made storable rather than refused, because refusing it would lose what it reports:
    NUL and unpaired surrogates become U+FFFD, and text above `max_length` characters is
    cut, ending with a marker that says how much was cut. Anything but a string is
    refused."""
    if not isinstance(value, str):
        raise InvalidInput(f"expected {name} to be a string, found {type(value).__name__}")
    return storable(value, max_length)


def storable(text: str, max_length: int = 4000) -> str:
    """`text` with NUL and unpaired surrogates replaced by U+FFFD, cut to `max_length`
    characters with a marker; never raises for a string."""
    text = _UNSTORABLE.sub("\ufffd", text)
    if len(text) > max_length:
        marker = CUT_MARKER.format(cut=len(text) - max_length)
        keep = max(max_length - len(marker), 0)
        marker = CUT_MARKER.format(cut=len(text) - keep)
        text = text[:keep] + marker
    return text


def describe_exception(exc: BaseException, max_length: int = 2000) -> str:
    """`Type: message` of an exception, storable; a `__str__` that raises is reported, not
    propagated."""
    try:
        message = str(exc)
    except Exception as failure:  # noqa: BLE001 - the description must not fail
        message = f"(its message could not be read: {type(failure).__name__})"
    return storable(f"{type(exc).__name__}: {message}", max_length)


def check_reason(reason: Any) -> str:
    """A person's reason for a decision: non-empty; returned without surrounding space,
    made storable (a reason is recorded, never refused for its characters)."""
    if not isinstance(reason, str) or not reason.strip():
        raise InvalidInput(f"expected a non-empty reason for the decision, found {reason!r}")
    return storable(reason.strip(), 2000)


# --- JSON -------------------------------------------------------------------------------


def _key_path(here: str, key: str) -> str:
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", key):
        return f"{here}.{key}"
    return f"{here}[{ascii(key)}]"


def check_json(value: Any, *, what: str = "intent", max_depth: int | None = None) -> Any:
    """Raise InvalidInput unless `value` is plain JSON the database can store, naming the
    path of what is wrong (`intent.items[3].n`); returns `value`.

    Plain JSON: dicts with string keys, lists or tuples, strings, finite floats, integers
    of at most 100 digits, booleans and None; strings and keys without NUL or unpaired
    surrogates; nested at most `max_depth` (default `LEDGER_MAX_JSON_DEPTH`) levels; no
    container inside itself. Walked with a stack of its own, never by recursion, so no
    input can exhaust Python's.
    """
    limit = conf.MAX_JSON_DEPTH if max_depth is None else max_depth
    # (value, where it sits, depth). Where it sits is a link (parent's link, key or index),
    # spelled out only for an error, and the containers on the way down are one set that a
    # marker left under a container's items clears again: linear in the size of the value,
    # however deep (a copied set and a path string per level made a deep value quadratic).
    stack: list[tuple[Any, Any, int]] = [(value, None, 0)]
    above: set[int] = set()
    while stack:
        node, link, depth = stack.pop()
        if node is _LEFT:
            above.discard(link)
            continue
        if node is None or isinstance(node, bool):
            continue
        if isinstance(node, str):
            if not _storable(node):
                _unstorable(node, _path(what, link))
            continue
        if isinstance(node, int):
            if not -_JSON_INT_LIMIT < node < _JSON_INT_LIMIT:
                digits = int(node.bit_length() * math.log10(2)) + 1
                raise InvalidInput(
                    f"expected {_path(what, link)} to be an integer of at most "
                    f"{MAX_JSON_INT_DIGITS} digits, found one of about {digits:,} digits; "
                    "store such numbers as strings"
                )
            continue
        if isinstance(node, float):
            if not math.isfinite(node):
                raise InvalidInput(
                    f"expected {_path(what, link)} to be a finite JSON number, found "
                    f"{node!r} (NaN and Infinity are not JSON)"
                )
            continue
        if not isinstance(node, Mapping | list | tuple):
            raise InvalidInput(
                f"expected {_path(what, link)} to hold only JSON values (object, array, "
                f"string, number, true, false, null), found {type(node).__name__} "
                f"{_short_repr(node)}"
            )
        if id(node) in above:
            raise InvalidInput(
                f"expected {what} to be a tree of JSON values, found {_path(what, link)} "
                "holding a container that also holds it (a cycle)"
            )
        if depth >= limit:
            raise InvalidInput(
                f"expected {what} nested at most {limit} levels deep "
                f"(LEDGER_MAX_JSON_DEPTH), found {_path(what, link)} deeper"
            )
        above.add(id(node))
        stack.append((_LEFT, id(node), depth))
        if isinstance(node, Mapping):
            items = []
            for key, item in node.items():
                if not isinstance(key, str):
                    raise InvalidInput(
                        f"expected every key in {_path(what, link)} to be a string, found "
                        f"{type(key).__name__} {_short_repr(key)}"
                    )
                if not _storable(key):
                    _unstorable(key, f"a key in {_path(what, link)}")
                items.append((item, (link, key), depth + 1))
            stack.extend(reversed(items))
        else:
            stack.extend(reversed([(item, (link, index), depth + 1)
                                   for index, item in enumerate(node)]))
    return value


_LEFT = object()  # check_json's marker: every item of the container below it is checked


def _path(what: str, link: Any) -> str:
    """`intent.items[3].n` from check_json's link of a node (None: the value itself)."""
    steps = []
    while link is not None:
        link, step = link
        steps.append(step)
    path = what
    for step in reversed(steps):
        path = f"{path}[{step}]" if isinstance(step, int) else _key_path(path, step)
    return path


def _short_repr(value: Any) -> str:
    if isinstance(value, int) and value.bit_length() > 1000:
        digits = int(value.bit_length() * math.log10(2)) + 1
        return f"an integer of about {digits:,} digits"
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a refusal must not fail on the value it refuses
        text = f"<{type(value).__name__}>"
    text = ascii(text)[1:-1] if _UNSTORABLE.search(text) else text
    return text if len(text) <= 60 else text[:57] + "..."


# --- names --------------------------------------------------------------------------------


def check_operation_name(value: Any) -> str:
    check_identifier(value, "operation", 200)
    if not _OPERATION_NAME.fullmatch(value):
        raise InvalidInput(
            "expected operation to be a name like 'articles.create' (letters, digits, "
            f"'_', '.', ':', '/', '-'), found {value!r}"
        )
    return value


def check_operation_pattern(value: Any) -> str:
    """An operation name that may hold the wildcards * and ? (retention policies)."""
    if (not isinstance(value, str) or not _OPERATION_PATTERN.fullmatch(value)
            or len(value) > 200):
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
    return value if value == "" else check_identifier(value, "tenant", 100)


def check_choice(value: Any, name: str, choices: Iterable[str]) -> str:
    choices = list(choices)
    if value not in choices:
        raise InvalidInput(f"expected {name} one of {choices}, found {value!r}")
    return value


# PostgreSQL's integer types: versions are `integer` columns, tokens and ids `bigint`. A
# number past them would reach the database as an "integer out of range" error.
PG_INTEGER_MAX = 2**31 - 1
PG_BIGINT_MAX = 2**63 - 1


def check_version(value: Any, name: str = "expected_version") -> int | None:
    """None, or a version: an int (never a bool) from 1 to PostgreSQL's integer maximum."""
    if value is None:
        return None
    return check_whole_number(value, low=1, high=PG_INTEGER_MAX,
                              expected=f"{name} to be None or a version from 1 to "
                              f"{PG_INTEGER_MAX} (a PostgreSQL integer)")


def check_whole_number(value: Any, *, low: int, high: int | None = None, expected: str) -> int:
    """An int (never a bool) from `low` to `high`; the refusal reads "expected <expected>,
    found <value>"."""
    if (isinstance(value, bool) or not isinstance(value, int) or value < low
            or (high is not None and value > high)):
        raise InvalidInput(f"expected {expected}, found {_short_repr(value)}")
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
    if not isinstance(values, Iterable) or isinstance(values, Mapping | bytes):
        raise InvalidInput(f"expected {name} to be a list of names, found "
                           f"{type(values).__name__} {_short_repr(values)}")
    result = list(values)
    for value in result:
        check_identifier(value, f"each of {name}", max_length)
    if len(set(result)) != len(result):
        raise InvalidInput(f"expected {name} without repeats, found {result!r}")
    return result


def check_paths(paths: Iterable[str], name: str) -> list[str]:
    """A list of dotted paths into a JSON object, like 'body.card'."""
    if isinstance(paths, str):
        raise InvalidInput(f"expected {name} to be a list of dotted paths, found a string")
    if not isinstance(paths, Iterable) or isinstance(paths, Mapping | bytes):
        raise InvalidInput(f"expected {name} to be a list of dotted paths, found "
                           f"{type(paths).__name__} {_short_repr(paths)}")
    result = list(paths)
    for path in result:
        if (not isinstance(path, str) or not path or path.startswith(".") or ".." in path
                or _NOT_IN_IDENTIFIER.search(path) or path != path.strip()):
            raise InvalidInput(
                f"expected each of {name} to be a dotted path like 'body.card', found {path!r}"
            )
    return result


def check_user(user: Any, doing: str) -> Any:
    """A saved user (a person's decision names them: `OperationEvent.decided_by`)."""
    if getattr(user, "pk", None) is None or not callable(getattr(user, "get_username", None)):
        raise InvalidInput(f"expected a saved user to {doing}, found {user!r}")
    return user


def check_fencing_token(value: Any) -> int | None:
    """None, or a fencing token (a positive int, never a bool)."""
    if value is None:
        return None
    return check_whole_number(value, low=1, high=PG_BIGINT_MAX,
                              expected="fencing_token to be None or a positive integer "
                              "(a bigint)")


def check_run_ref(value: Any, name: str = "run") -> Any:
    """A run named by its run_id is an identifier; a Run object is checked where it is
    looked up."""
    if isinstance(value, str):
        check_identifier(value, name, 100)


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
