"""Effects no receipt explains: what a target shows that the ledger never recorded.

A reconciler that can list a target's effects (`Reconciler.list_effects`; `list_and_match`
does) is asked for those in a time range, read as the provider account; each effect is
explained when a receipt of the same tenant, operation, target and account names it: its
external id, or its idempotency key (a receipt whose outcome is still unknown explains the
effect its request made). The rest were made around the ledger: by a person by hand, by
another tool, by a bug that sent without a receipt.

`read` stores what it saw as a `CoverageReading` (append-only: the reading, when, by whom,
the effects no receipt explains, and whether the listing was complete); nothing is written
to operations. `manage.py coverage --target T --since ISO` runs it, the desk's coverage
page lists the readings, and `/metrics` counts the unexplained effects of the latest
reading per target (`ledger_unexplained_effects`).

Retention (`ledger.retention_state`, kind `coverage`, 90 days by default) purges readings
its policy's days after they were taken, never the latest of a tenant, operation name,
target and account, however old: `/metrics` and the page show the same latest readings
before and after a purge.

A listing that hit its bound (`complete` False) shows only part of the range: its
unexplained effects are real, but there may be more. A reader that cannot see (a wrong
account or token) lists nothing and so finds nothing unexplained: a reading of zero effects
on a target where receipts say effects exist is reported as such (`blind_suspect`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from ledger import reconcile
from ledger.canonical import redact, scrub_text
from ledger.errors import InvalidInput
from ledger.inputs import (
    check_identifier,
    check_json,
    check_operation_name,
    check_string,
    describe_exception,
    storable,
)
from ledger.models import CoverageReading, Operation
from ledger.receipts import check_account
from ledger.states import State

# How many unexplained effects one reading keeps (the count says how many there were).
MAX_KEPT = 200


@dataclass(frozen=True)
class Summary:
    """A stored reading and whether it may be blind: it listed nothing, while succeeded
    receipts of the range say effects exist."""

    reading: CoverageReading
    blind_suspect: bool


def operations_on(target: str, *, tenant: str, account: str) -> list[str]:
    """The operation names with receipts on `target` (and `account`) in `tenant`."""
    return sorted(set(Operation.objects.filter(tenant=tenant, target=target, account=account)
                      .values_list("operation", flat=True).distinct()))


def read(target: str, *, since: datetime, until: datetime | None = None,
         operation: str | None = None, tenant: str = "default", account: str = "",
         actor: str = "") -> list[Summary]:
    """Read the effects at `target` in [since, until] (until: now) as `account`, with the
    reconciler of each operation name that has receipts on it (or of `operation` alone),
    and store one CoverageReading per name. A reconciler without `list_effects` is left
    out; one that fails is stored with its error. InvalidInput for bad arguments."""
    target = check_string(target, "target", 2000)
    check_identifier(target, "target", 2000)
    target = scrub_text(target)
    check_identifier(tenant, "tenant", 100)
    account = check_account(account)
    if actor:
        check_identifier(actor, "actor", 200)
    until = until or timezone.now()
    for name, value in (("since", since), ("until", until)):
        if not isinstance(value, datetime) or timezone.is_naive(value):
            raise InvalidInput(f"expected {name} to be an aware datetime, found {value!r}")
    if since >= until:
        raise InvalidInput(f"expected since before until, found {since.isoformat()} and "
                           f"{until.isoformat()}")
    names = [check_operation_name(operation)] if operation else operations_on(
        target, tenant=tenant, account=account)
    summaries = []
    for name in names:
        cls = reconcile.reconciler_for(name)
        if cls is None or cls.list_effects is reconcile.Reconciler.list_effects:
            continue
        summaries.append(_read_one(cls, name, target=target, since=since, until=until,
                                   tenant=tenant, account=account, actor=actor))
    return summaries


def _read_one(cls, name: str, *, target: str, since: datetime, until: datetime, tenant: str,
              account: str, actor: str) -> Summary:
    scope = Operation(operation_id="coverage", tenant=tenant, operation=name, target=target,
                      account=account, intent={}, intent_fingerprint="", idempotency_key="",
                      state=State.SUCCEEDED, created_at=since, state_changed_at=since)
    row = CoverageReading(tenant=tenant, operation=name, target=target, account=account,
                          since=since, until=until, reconciler=storable(cls.label(), 200),
                          read_by=actor or "")
    try:
        effects = cls().list_effects(scope, since, until)
        if not isinstance(effects, reconcile.Effects):
            raise InvalidInput(f"expected list_effects to return reconcile.Effects, found "
                               f"{effects!r}")
        items = [_effect(item) for item in effects.items]
        check_json(effects.query, what="query")
        row.query = redact(effects.query)
        row.complete = bool(effects.complete)
    except Exception as exc:  # noqa: BLE001 - a reader's failure is what the reading says
        items = []
        row.error = scrub_text(describe_exception(exc, 2000))
        row.complete = False
    unexplained = _unexplained(items, tenant=tenant, name=name, target=target,
                               account=account)
    row.listed = len(items)
    row.explained = len(items) - len(unexplained)
    row.unexplained_count = len(unexplained)
    row.unexplained = unexplained[:MAX_KEPT]
    row.created_at = timezone.now()
    with transaction.atomic(durable=True):
        row.save(force_insert=True)
    succeeded_in_range = Operation.objects.filter(
        tenant=tenant, operation=name, target=target, account=account,
        state=State.SUCCEEDED, completed_at__gte=since, completed_at__lte=until).exists()
    return Summary(row, blind_suspect=not row.error and not items and succeeded_in_range)


def _effect(item) -> dict:
    if not isinstance(item, dict) or not item.get("external_id"):
        raise InvalidInput(f"expected each effect to be a dict with an external_id, found "
                           f"{item!r}")
    check_json(item, what="effect")
    key = item.get("idempotency_key")
    return {"external_id": scrub_text(storable(str(item["external_id"]), 500)),
            "idempotency_key": str(key) if key else "",
            "at": item.get("at"), "item": redact(item.get("item", {}))}


def _unexplained(items: list[dict], *, tenant: str, name: str, target: str,
                 account: str) -> list[dict]:
    """The effects of `items` no receipt of (tenant, name, target, account) names, by
    external id or idempotency key. Two queries, whatever the number of items."""
    if not items:
        return []
    ids = {item["external_id"] for item in items}
    keys = {item["idempotency_key"] for item in items if item["idempotency_key"]}
    receipts = Operation.objects.filter(tenant=tenant, operation=name, target=target,
                                        account=account)
    named = set(receipts.filter(Q(external_id__in=ids)).values_list("external_id", flat=True))
    keyed = set(receipts.filter(idempotency_key__in=keys).values_list("idempotency_key",
                                                                     flat=True)) if keys else set()
    return [item for item in items
            if item["external_id"] not in named and item["idempotency_key"] not in keyed]


def readings(user, *, target: str = "", limit: int = 50) -> list[CoverageReading]:
    """The latest coverage readings of the tenants `user` may see, newest first, those of
    `target` alone when given: one query."""
    from ledger.selectors.base import visible

    qs = visible(user, CoverageReading)
    if target:
        qs = qs.filter(target=target)
    return list(qs.order_by("-created_at", "-id")[:limit])
