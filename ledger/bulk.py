"""One decision on many operations at once: the desk's bulk action on the queue.

Each operation goes through `receipts.resolve` on its own, with the version the reviewer
saw and its own event: one that changed meanwhile, that this person may not decide, or
that no longer waits on anyone is skipped and reported with why, never decided twice.
An operation that takes two people (`receipts.resolve`'s two-person rule) is skipped too,
"consequential: needs a second person": the first reviewer's bulk decision records a
proposal on each, a different reviewer's same bulk decision completes them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ledger import access, errors, receipts, states
from ledger.inputs import check_choice, check_identifier, check_reason, check_whole_number
from ledger.selectors.operations import visible_operations

# The most operations one bulk decision takes (the desk says so next to "select all").
BULK_CAP = 500


@dataclass
class BulkResult:
    decided: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (operation id, why)


def resolve_many(
    items: Iterable[tuple[str, int]],
    to_state: str,
    *,
    user,
    reason: str,
) -> BulkResult:
    """Resolve each (operation_id, version seen) to `to_state` with one reason.

    Needs `ledger.resolve_operation` (PermissionDenied, nothing written); each operation is
    then checked like a single decision (tenant, retry policy override, version). At most
    BULK_CAP items (InvalidInput otherwise). One query to fetch them all, then one
    decision (one statement) per item; a skipped item costs the queries saying why.
    """
    check_choice(to_state, "to_state", states.RESOLUTIONS)
    reason = check_reason(reason)
    items = list(items)
    if len(items) > BULK_CAP:
        raise errors.InvalidInput(f"expected at most {BULK_CAP} operations in one bulk "
                                  f"decision, found {len(items)}")
    for operation_id, version in items:
        check_identifier(operation_id, "operation_id", 40)
        check_whole_number(version, low=1, expected=f"a version >= 1 for {operation_id}")
    access.require_perm(user, "ledger.resolve_operation", doing="resolve operations")
    ids = [operation_id for operation_id, _ in items]
    found = {op.operation_id: op
             for op in visible_operations(user).filter(operation_id__in=ids)}
    result = BulkResult()
    seen: set[str] = set()
    for operation_id, version in items:
        op = found.get(operation_id)
        if operation_id in seen:
            result.skipped.append((operation_id, "listed twice; decided once"))
            continue
        seen.add(operation_id)
        if op is None:
            result.skipped.append((operation_id, "not found among your tenants"))
            continue
        try:
            receipts.resolve(op, to_state, user=user, reason=reason, expected_version=version)
        except errors.SecondPersonRequired as exc:
            result.skipped.append((operation_id, f"consequential: needs a second person "
                                                 f"({exc})"))
        except errors.StaleVersion as exc:
            result.skipped.append((operation_id, f"changed meanwhile: {exc}"))
        except errors.PermissionDenied as exc:
            result.skipped.append((operation_id, f"not permitted: {exc}"))
        except (errors.IllegalTransition, errors.InvalidInput) as exc:
            result.skipped.append((operation_id, f"not decided: {exc}"))
        else:
            if op.version == version:  # the first of two people: a proposal, recorded
                result.skipped.append((operation_id, f"consequential: needs a second person "
                                                     f"(proposed: {to_state} by "
                                                     f"{user.get_username()})"))
            else:
                result.decided.append(operation_id)
    return result
