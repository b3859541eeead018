"""Unknown-outcome policies per kind of operation, set by admins on the desk, audited.

What an unproven outcome of an operation may become (`ledger.reconcile` reads it as it
stores a verdict): whether a proven absence may become safe_to_retry without a person
(payments: never), how many failed or blind readings lead to manual_review, and how long
NotYet may last. The defaults are in code and settings: LEDGER_UNKNOWN_OUTCOME_POLICIES, then
the reconciler's own `max_failures` and `grace_period`. A desk row of the operation's tenant
whose pattern matches wins over the setting (the exact name first, then the pattern with the
most literal characters).

`set_policy` is the one writer: it needs `ledger.change_unknownoutcomepolicy` (admins) and
the tenant's grant, takes a reason, and writes the row and its append-only change (before,
after, who, why) in one transaction. Both tables are under the records chain.
"""

from __future__ import annotations

from datetime import timedelta

from ledger import access, audited, conf
from ledger.errors import InvalidInput
from ledger.inputs import (
    check_duration,
    check_identifier,
    check_operation_pattern,
    check_positive_duration,
    check_reason,
    check_whole_number,
)
from ledger.models import UnknownOutcomePolicy, UnknownOutcomePolicyChange
from ledger.selectors.base import visible

MAX_ATTEMPTS = 100
MAX_WINDOW = timedelta(days=90)


def set_policy(
    pattern: str,
    *,
    user,
    reason: str,
    tenant: str = "default",
    automatic_retry: bool = True,
    attempts: int | None = None,
    window: timedelta | None = None,
) -> UnknownOutcomePolicy:
    """Create or change the unknown-outcome policy of (`tenant`, `pattern`), audited with
    `reason`. `attempts` None: the reconciler's `max_failures`; `window` None: its
    `grace_period`. Setting the same values again writes nothing."""
    check_operation_pattern(pattern)
    check_identifier(tenant, "tenant", 100)
    reason = check_reason(reason)
    if not isinstance(automatic_retry, bool):
        raise InvalidInput(f"expected automatic_retry to be a boolean, found {automatic_retry!r}")
    if attempts is not None:
        check_whole_number(attempts, low=1, high=MAX_ATTEMPTS,
                           expected=f"attempts from 1 to {MAX_ATTEMPTS}, or none")
    if window is not None:
        check_positive_duration(window, "window")
        check_duration(window, "window", high=MAX_WINDOW)
    access.require_perm(user, "ledger.change_unknownoutcomepolicy",
                        doing="set unknown-outcome policies")
    access.require_tenant(user, tenant)
    values = {"automatic_retry": automatic_retry, "attempts": attempts,
              "not_yet_window": window}
    return audited.set_policy_row(UnknownOutcomePolicy, UnknownOutcomePolicyChange,
                                  tenant=tenant, pattern=pattern, values=values, user=user,
                                  reason=reason)


def policies_page(user) -> dict:
    """The desk's page: the policies of the user's tenants, their recent changes, and the
    defaults from LEDGER_UNKNOWN_OUTCOME_POLICIES (what applies where no row matches)."""
    access.require_perm(user, "ledger.view_unknownoutcomepolicy",
                        doing="see unknown-outcome policies")
    defaults = [
        {"pattern": pattern, "automatic_retry": spec.get("automatic_retry", True),
         "attempts": spec.get("attempts"),
         "window": (timedelta(seconds=spec["window_seconds"])
                    if spec.get("window_seconds") is not None else None)}
        for pattern, spec in sorted(conf.UNKNOWN_OUTCOME_POLICIES.items())
    ]
    return {
        "policies": list(visible(user, UnknownOutcomePolicy).select_related("updated_by")),
        "changes": list(visible(user, UnknownOutcomePolicyChange)[:50]),
        "defaults": defaults,
    }
