"""Keyset pagination, the one way every list read pages.

A page is ordered on (a timestamp column, id) and continues after the last row shown: the
`cursor` names that row's timestamp and id, so a page costs one query whatever its position
and never counts the table (one row more than the page says whether a next page exists).
A list ordered on a unique sortable key (the HTTP API's operations, on their ids) pages the
same way on that key alone (`key_page`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db.models import Q, QuerySet

from ledger.errors import InvalidInput
from ledger.inputs import check_whole_number

MAX_PAGE_SIZE = 200


@dataclass
class Page:
    items: list[Any]
    next_cursor: str = ""
    per_page: int = 50
    # Where the page before this one ends (`before=` of keyset_page); "" on the first page.
    previous_cursor: str = ""


def make_cursor(at: datetime, pk: int) -> str:
    """An opaque position: the sort timestamp and the id of the last row shown."""
    return f"{at.isoformat()}~{pk}"


def parse_cursor(cursor: str) -> tuple[datetime, int]:
    stamp, sep, pk = cursor.rpartition("~")
    try:
        if not sep:
            raise ValueError(cursor)
        at = datetime.fromisoformat(stamp)
        if at.tzinfo is None:
            raise ValueError(cursor)
        return at, int(pk)
    except ValueError:
        raise InvalidInput(
            "expected a page cursor like '2026-08-16T01:20:30+00:00~42' (from a 'Next' link), "
            f"found {cursor[:80]!r}"
        ) from None


def check_per_page(per_page: int) -> int:
    return check_whole_number(
        per_page, low=1, high=MAX_PAGE_SIZE,
        expected=f"a page size between 1 and {MAX_PAGE_SIZE}",
    )


def after_cursor(qs: QuerySet, column: str, cursor: str, *, descending: bool) -> QuerySet:
    """The rows of `qs` that come after `cursor` in (`column`, id) order."""
    if not cursor:
        return qs
    at, pk = parse_cursor(cursor)
    if descending:
        return qs.filter(Q(**{f"{column}__lt": at}) | Q(**{column: at, "pk__lt": pk}))
    return qs.filter(Q(**{f"{column}__gt": at}) | Q(**{column: at, "pk__gt": pk}))


def keyset_page(
    qs: QuerySet, column: str, *, cursor: str = "", per_page: int = 50, descending: bool,
    before: str = "",
) -> dict[str, Any]:
    """One page of `qs` (already ordered on (`column`, id) in the direction `descending`
    says) after `cursor`, or the page that ends just before `before` (a `previous_cursor`),
    as the fields of a `Page`: one query. Raises InvalidInput for a malformed cursor or
    page size."""
    per_page = check_per_page(per_page)
    if before:
        # Read backwards from `before`, then show the rows in the page's order.
        backwards = qs.reverse()
        rows = list(after_cursor(backwards, column, before, descending=not descending)
                    [: per_page + 1])
        items = rows[:per_page][::-1]
        result: dict[str, Any] = {"items": items, "per_page": per_page}
        if items:
            result["next_cursor"] = _cursor_of(items[-1], column)
            if len(rows) > per_page:
                result["previous_cursor"] = _cursor_of(items[0], column)
        return result
    rows = list(after_cursor(qs, column, cursor, descending=descending)[: per_page + 1])
    result = {"items": rows[:per_page], "per_page": per_page}
    if len(rows) > per_page:
        result["next_cursor"] = _cursor_of(rows[per_page - 1], column)
    if cursor and rows:
        # Came here from a page before: it ends just before this page's first row.
        result["previous_cursor"] = _cursor_of(rows[0], column)
    return result


def key_page(qs: QuerySet, column: str, *, cursor: str = "", per_page: int = 50,
             descending: bool) -> dict[str, Any]:
    """One page of `qs` ordered on `column`, a unique and sortable key (an operation id),
    after `cursor` (the key of the last row shown), as the fields of a `Page`: one query.
    The cursor is the key itself, so the API's cursors read as the ids they are."""
    per_page = check_per_page(per_page)
    if cursor:
        qs = qs.filter(**{f"{column}__{'lt' if descending else 'gt'}": cursor})
    rows = list(qs.order_by(f"-{column}" if descending else column)[: per_page + 1])
    result: dict[str, Any] = {"items": rows[:per_page], "per_page": per_page}
    if len(rows) > per_page:
        result["next_cursor"] = getattr(rows[per_page - 1], column)
    return result


def _cursor_of(row, column: str) -> str:
    return make_cursor(getattr(row, column), row.pk)


def iter_keyset(qs: QuerySet, column: str, *, descending: bool, batch: int = 500) -> Iterator:
    """Every row of `qs`, fetched in keyset batches of `batch` (for exports)."""
    cursor = ""
    while True:
        rows = list(after_cursor(qs, column, cursor, descending=descending)[:batch])
        yield from rows
        if len(rows) < batch:
            return
        cursor = make_cursor(getattr(rows[-1], column), rows[-1].pk)
