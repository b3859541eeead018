"""What every read starts from: the rows of the tenants a principal may see.

A principal is whoever asks: a desk user now, an agent key later; anything
`ledger.access.tenants_for` can answer for. `visible` is the one tenant filter, and
`fetch_one` the one way a single object is fetched and checked: a row of a tenant the
principal may not see is not found (errors.NotFound), exactly like a row that does not exist,
so a 404 never tells one from the other.
"""

from __future__ import annotations

from django.db.models import Model, QuerySet

from ledger import access
from ledger.errors import InvalidInput, NotFound
from ledger.inputs import check_identifier


def visible[M: Model](principal, rows: type[M] | QuerySet[M]) -> QuerySet[M]:
    """`rows` (a model with a `tenant` column, or a queryset of one) limited to the tenants
    `principal` may see: every tenant for a superuser, none without a grant."""
    qs = rows._default_manager.all() if isinstance(rows, type) else rows
    tenants = access.tenants_for(principal)
    return qs if tenants is None else qs.filter(tenant__in=tenants)


def fetch_one[M: Model](qs: QuerySet[M], what: str, **lookup) -> M:
    """The one row of `qs` matching `lookup`, or NotFound naming `what` ("operation X").

    `qs` is already limited to what the principal may see (`visible`), so the fetch and the
    check are one query.
    """
    found = list(qs.filter(**lookup)[:2])
    if not found:
        raise NotFound(f"expected {what} among the tenants you may see, found none")
    if len(found) > 1:
        raise InvalidInput(f"expected {what} to name one record among the tenants you may "
                           "see, found one in each of several; name the tenant")
    return found[0]


def lookup_id(value, *, what: str, name: str, max_length: int) -> str:
    """An id to fetch by, as a URL or a request gave it: anything but a string of 1 to
    `max_length` characters names nothing (NotFound, "expected <what>, found ..."); one with
    control characters, unpaired surrogates or surrounding whitespace is refused by the
    input gate (InvalidInput naming `name`)."""
    if not isinstance(value, str) or not 0 < len(value) <= max_length:
        raise NotFound(f"expected {what}, found {value!r}")
    return check_identifier(value, name, max_length)


def capped_count(qs: QuerySet, cap: int) -> tuple[int, bool]:
    """How many rows `qs` has, counted up to `cap` (then shown as "cap+"): one query that
    never counts a whole table. Returns (count, whether the cap was passed)."""
    n = qs.order_by().values("pk")[: cap + 1].count()
    return min(n, cap), n > cap
