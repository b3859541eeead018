"""`manage.py coverage --target T --since ISO [--until ISO] [--operation NAME] [--tenant T]
[--account A] [--json]`: the effects at a target that no receipt explains."""

import json
from datetime import datetime

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from ledger import coverage
from ledger.errors import LedgerError


def _moment(value: str, name: str) -> datetime:
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise CommandError(f"expected --{name} as an ISO 8601 date or time "
                           f"(2026-12-01, 2026-12-01T08:00Z), found {value!r}") from None
    return moment if timezone.is_aware(moment) else timezone.make_aware(moment, timezone.utc)


class Command(BaseCommand):
    help = ("Read the effects at a target in a time range with its reconcilers, and list "
            "those no receipt explains (made around the ledger: by hand, another tool, a "
            "bug). Stores the reading (the desk's coverage page, /metrics); writes nothing "
            "to operations. Exit status 1 when some effect is unexplained.")

    def add_arguments(self, parser):
        parser.add_argument("--target", required=True)
        parser.add_argument("--since", required=True, help="ISO 8601; UTC when no offset")
        parser.add_argument("--until", default=None, help="ISO 8601 (default: now)")
        parser.add_argument("--operation", default=None,
                            help="only this operation name (default: every name with "
                                 "receipts on the target)")
        parser.add_argument("--tenant", default="default")
        parser.add_argument("--account", default="", help="the provider account to read as")
        parser.add_argument("--actor", default="", help="who ran it, on the reading")
        parser.add_argument("--json", action="store_true", dest="as_json",
                            help="one JSON object per reading")

    def handle(self, *args, target, since, until, operation, tenant, account, actor, as_json,
               **options):
        try:
            summaries = coverage.read(
                target, since=_moment(since, "since"),
                until=_moment(until, "until") if until else None, operation=operation,
                tenant=tenant, account=account, actor=actor)
        except LedgerError as exc:
            raise CommandError(str(exc)) from None
        if not summaries:
            raise CommandError(f"expected a reconciler that can list the effects at "
                               f"{target!r} (list_effects, e.g. list_and_match), found none "
                               f"for {operation or 'the operations with receipts there'}")
        unexplained = 0
        for summary in summaries:
            reading = summary.reading
            unexplained += reading.unexplained_count
            if as_json:
                self.stdout.write(_json(summary))
                continue
            self.stdout.write(_text(summary))
        if unexplained:
            raise SystemExit(1)


def _json(summary) -> str:
    reading = summary.reading
    return json.dumps({
        "reading": reading.pk, "tenant": reading.tenant, "operation": reading.operation,
        "target": reading.target, "account": reading.account,
        "since": reading.since.isoformat(), "until": reading.until.isoformat(),
        "reconciler": reading.reconciler, "query": reading.query, "listed": reading.listed,
        "complete": reading.complete, "explained": reading.explained,
        "unexplained_count": reading.unexplained_count, "unexplained": reading.unexplained,
        "error": reading.error, "blind_suspect": summary.blind_suspect}, sort_keys=True)


def _text(summary) -> str:
    reading = summary.reading
    how = reading.query.get("request") or reading.query.get("listing") or "its listing"
    lines = [f"{reading.operation} on {reading.target}"
             + (f" as {reading.account}" if reading.account else "")
             + f", {reading.since:%Y-%m-%dT%H:%M:%SZ} to {reading.until:%Y-%m-%dT%H:%M:%SZ}: "
             f"read by {reading.reconciler} ({how}), "
             f"{reading.listed} effect(s) listed, {reading.explained} explained by a "
             f"receipt, {reading.unexplained_count} unexplained (reading {reading.pk})"]
    if reading.error:
        lines.append(f"  the reading failed: {reading.error}")
    if not reading.complete and not reading.error:
        lines.append("  the listing hit its bound: more effects may exist than it showed")
    if summary.blind_suspect:
        lines.append("  it listed nothing, while receipts say effects succeeded in the range: "
                     "the reader may be blind (a wrong account, URL or token)")
    for effect in reading.unexplained:
        lines.append(f"  unexplained: {effect['external_id']}"
                     + (f" key={effect['idempotency_key']}" if effect["idempotency_key"] else
                        " (no idempotency key)")
                     + (f" at {effect['at']}" if effect.get("at") else ""))
    if reading.unexplained_count > len(reading.unexplained):
        lines.append(f"  ... and {reading.unexplained_count - len(reading.unexplained)} more")
    return "\n".join(lines)
