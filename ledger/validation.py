"""A check before sending: an operation kind may declare what a sendable intent looks like.

Beside (not instead of) approvals and policies: a validator runs on the recorded receipt
right before it is submitted (`receipts.mark_submitted`, which every way of sending goes
through: `receipts.submit`, the decorators, the HTTP API, MCP and the gateway). A refusal
is recorded and nothing is sent: the operation moves to `abandoned` (the state machine's
one way out of planned or safe_to_retry that is not a send; `rejected` is the provider's
refusal of a request that was sent) with `error_code` "validation_refused", the
validator's reason as `error_detail` and on the event, and `errors.ValidationRefused` is
raised with the operation.

Two ways to declare a kind's checks, both by operation name or pattern (`payments.*`):

- rules, as data the API and the gateway can carry (`LEDGER_OPERATION_RULES`, or
  `set_rules` in code), each a dict of:
    `required`: dotted intent paths that must be present and not empty;
    `ranges`: {path: {"min": number, "max": number}} (either bound may be left out);
    `one_of`: {path: [allowed values]};
    `targets`: fnmatch patterns the target must match one of;
    `accounts`: fnmatch patterns the provider account must match one of;
- a function of the operation, in process (`@validation.validator("payments.refund")`),
  returning None when the intent may be sent, or the reason, in words, why not (raising
  `Refused(reason)` says the same; any other exception refuses too, naming it).

Every matching rule list and function applies; the first refusal is the one recorded. The
rules see the intent as stored (after `keep` and redaction): a field that is not stored
cannot be checked, and a rule that requires it refuses.
"""

from __future__ import annotations

import fnmatch
import threading
from collections.abc import Callable, Mapping
from typing import Any

from ledger import conf
from ledger.canonical import REDACTED
from ledger.errors import InvalidInput
from ledger.inputs import check_operation_pattern

# The error code a refused operation is recorded with.
REFUSED_CODE = "validation_refused"
RULE_KEYS = frozenset({"required", "ranges", "one_of", "targets", "accounts"})

_functions: dict[str, list[Callable[[Any], str | None]]] = {}
_rules: dict[str, dict[str, Any]] = {}
_lock = threading.Lock()


class Refused(Exception):
    """Raised by a validator function: the intent must not be sent, for `reason`."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def validator(pattern: str) -> Callable[[Callable], Callable]:
    """Decorator: `fn(op)` checks every operation whose name matches `pattern` before it is
    sent; it returns None (send) or the reason not to."""
    check_operation_pattern(pattern)

    def register(fn):
        if not callable(fn):
            raise InvalidInput(f"expected a validator to be a function of the operation, "
                               f"found {fn!r}")
        with _lock:
            if fn not in _functions.setdefault(pattern, []):
                _functions[pattern].append(fn)
        return fn

    return register


def set_rules(pattern: str, rules: Mapping[str, Any] | None) -> None:
    """Declare (None: forget) the rule list of operations matching `pattern` in code,
    beside those of LEDGER_OPERATION_RULES. InvalidInput for a malformed list."""
    check_operation_pattern(pattern)
    with _lock:
        if rules is None:
            _rules.pop(pattern, None)
        else:
            _rules[pattern] = check_rules(rules, what=f"the rules of {pattern!r}")


def forget(pattern: str) -> None:
    """Drop the functions and code rules of `pattern` (tests, plug-in reloads)."""
    with _lock:
        _functions.pop(pattern, None)
        _rules.pop(pattern, None)


def check_rules(rules: Any, *, what: str = "rules") -> dict[str, Any]:
    """`rules` as a rule list (see the module docstring), or InvalidInput naming the part
    that is not."""
    if not isinstance(rules, Mapping) or not set(rules) <= RULE_KEYS:
        raise InvalidInput(f"expected {what} to be a dict of {sorted(RULE_KEYS)}, found "
                           f"{rules!r}")
    checked = dict(rules)
    for key in ("required", "targets", "accounts"):
        value = checked.get(key, [])
        if not isinstance(value, list | tuple) or not all(
                isinstance(v, str) and v.strip() for v in value):
            raise InvalidInput(f"expected {what}: {key} to be a list of non-empty strings, "
                               f"found {value!r}")
    ranges = checked.get("ranges", {})
    if not isinstance(ranges, Mapping) or not all(
            isinstance(bounds, Mapping) and bounds and set(bounds) <= {"min", "max"}
            and all(_is_number(b) for b in bounds.values())
            for bounds in ranges.values()):
        raise InvalidInput(f"expected {what}: ranges to map paths to {{'min': n, 'max': n}}, "
                           f"found {ranges!r}")
    one_of = checked.get("one_of", {})
    if not isinstance(one_of, Mapping) or not all(
            isinstance(values, list | tuple) and values for values in one_of.values()):
        raise InvalidInput(f"expected {what}: one_of to map paths to lists of allowed "
                           f"values, found {one_of!r}")
    return checked


def refusal(op: Any) -> str:
    """Why `op` must not be sent, by the first rule or function of its name that refuses
    it; "" when none does. Never raises for a validator's sake."""
    name = op.operation
    for pattern, rules in _rule_lists():
        if fnmatch.fnmatchcase(name, pattern):
            why = _broken_rule(op, rules)
            if why:
                return f"{why} (rules of {pattern})"
    with _lock:
        functions = [(p, fn) for p, fns in _functions.items() for fn in fns]
    for pattern, fn in functions:
        if not fnmatch.fnmatchcase(name, pattern):
            continue
        label = getattr(fn, "__qualname__", repr(fn))
        try:
            why = fn(op)
        except Refused as exc:
            why = exc.reason or "refused"
        except Exception as exc:  # noqa: BLE001 - a validator that fails lets nothing through
            why = f"the validator raised {type(exc).__name__}: {exc}"
        if why is not None and not isinstance(why, str):
            why = f"the validator returned {why!r}, not None or a reason"
        if why:
            return f"{why} (validator {label})"
    return ""


def has_checks() -> bool:
    """Whether any rule or validator is declared (the write path skips the rest when not)."""
    return bool(conf.OPERATION_RULES or _rules or _functions)


def _rule_lists() -> list[tuple[str, dict[str, Any]]]:
    with _lock:
        declared = list(_rules.items())
    return [*conf.OPERATION_RULES.items(), *declared]


_MISSING = object()


def _at(intent: Any, path: str) -> Any:
    here = intent
    for part in path.split("."):
        if isinstance(here, Mapping) and part in here:
            here = here[part]
        elif isinstance(here, list) and part.isdigit() and int(part) < len(here):
            here = here[int(part)]
        else:
            return _MISSING
    return here


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _broken_rule(op: Any, rules: Mapping[str, Any]) -> str:
    """The first rule `op` breaks, in words ("" when it keeps them all)."""
    intent = op.intent or {}
    for path in rules.get("required", ()):
        value = _at(intent, path)
        if value is _MISSING or value in (None, "", [], {}) or value == REDACTED:
            found = ("none" if value is _MISSING else "it redacted" if value == REDACTED
                     else repr(value))
            return f"expected {path} in the intent, found {found}"
    for path, bounds in rules.get("ranges", {}).items():
        value = _at(intent, path)
        if value is _MISSING:
            continue  # `required` says whether it must be there
        low, high = bounds.get("min"), bounds.get("max")
        if not _is_number(value) or (low is not None and value < low) or (
                high is not None and value > high):
            return (f"expected {path} to be a number from {low if low is not None else '-inf'}"
                    f" to {high if high is not None else 'inf'}, found {value!r}")
    for path, allowed in rules.get("one_of", {}).items():
        value = _at(intent, path)
        if value is not _MISSING and value not in allowed:
            return f"expected {path} to be one of {list(allowed)!r}, found {value!r}"
    targets = rules.get("targets")
    if targets and not any(fnmatch.fnmatchcase(op.target, t) for t in targets):
        return f"expected the target to match one of {list(targets)!r}, found {op.target!r}"
    accounts = rules.get("accounts")
    if accounts and not any(fnmatch.fnmatchcase(op.account, a) for a in accounts):
        return (f"expected the provider account to match one of {list(accounts)!r}, found "
                f"{op.account!r}")
    return ""


def check_rule_setting(app_configs=None, **kwargs) -> list:
    """`manage.py check`: each rule list of LEDGER_OPERATION_RULES as `check_rules` takes it
    (ledger.E001 naming the pattern and what is wrong)."""
    from django.core import checks

    errors = []
    rules = conf.OPERATION_RULES
    if not isinstance(rules, Mapping):
        return errors  # conf.check_settings names a setting of the wrong shape
    for pattern, listed in rules.items():
        try:
            check_rules(listed, what=f"LEDGER_OPERATION_RULES[{pattern!r}]")
        except InvalidInput as exc:
            errors.append(checks.Error(str(exc), hint=conf.SETTINGS["OPERATION_RULES"].doc,
                                       id="ledger.E001"))
    return errors
