"""A bounded list-and-match: list the recent items, match them on intent fields."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

from ledger import reconcile
from ledger.canonical import REDACTED, scrub_text
from ledger.errors import InvalidInput
from ledger.models import Operation
from ledger.reconcilers import _kit
from ledger.reconcilers.lookup import LookupFailed


class ListAndMatch(reconcile.Reconciler):
    """List at most `limit` recent items and match them; built by `list_and_match`."""

    url: str | Callable[[Operation], str] | None = None
    listing: Callable[[Operation, int], Any] | None = None
    items = ""
    limit = 50
    match: tuple[tuple[str, str], ...] = ()
    external_id: str | Callable[[Any], Any] = "id"
    since_margin = timedelta(minutes=1)
    consistent_as_of: str | Callable[[Any], Any] | None = None
    exclude_attributed = True
    idempotency_key: str | Callable[[Any], Any] | None = "idempotency_key"
    effect_time: str | Callable[[Any], Any] | None = None
    headers: Mapping[str, str] | Callable[[Operation], Mapping[str, str]] | None = None
    timeout = 5.0
    client: Any = None

    def lookup(self, op: Operation):
        return None  # nothing to read by key: the search decides

    def search(self, op: Operation):
        wanted = self._wanted(op)
        query: dict[str, Any] = {"method": "search", "match": wanted, "limit": self.limit}
        body, items = self._listing(op, (op.created_at - self.since_margin).isoformat(), query)
        complete = len(items) < self.limit
        matches = [item for item in items if self._matches(item, wanted)]
        attributed = self._attributed_elsewhere(op, matches)
        matches = [m for m in matches if self._id(m) not in attributed]
        observed = {"listed": len(items), "limit": self.limit, "complete": complete,
                    "matches": _kit.observed_body(matches),
                    "attributed_to_other_operations": sorted(attributed)}
        if self.service_has_keys and len(matches) > 1:
            # The match under this operation's own key is its effect, whatever else the
            # listing holds; a match under another key is not (the engine: Ambiguous).
            mine = [m for m in matches if self._key(m) == op.idempotency_key]
            if len(mine) == 1:
                return reconcile.Found(self._id(mine[0]), observed, query=query,
                                       matched_by="idempotency_key",
                                       idempotency_key=op.idempotency_key)
        if not complete:
            return reconcile.Ambiguous(
                observed, query=query, matched_by="fingerprint",
                reason=f"the listing hit its bound of {self.limit} items, so it may not hold "
                "every recent item: absence is not proven",
            )
        if len(matches) == 1:
            return reconcile.Found(self._id(matches[0]), observed, query=query,
                                   matched_by="fingerprint",
                                   idempotency_key=self._key(matches[0]))
        if len(matches) > 1:
            return reconcile.Ambiguous(
                observed, query=query, matched_by="fingerprint",
                reason=f"{len(matches)} items match on {', '.join(wanted)}",
            )
        why = _kit.not_visible_yet(op, body, self.consistent_as_of)
        if why:
            return reconcile.NotYet({**observed, "not_yet": why}, query=query)
        return reconcile.ProvenAbsent(observed, query=query, matched_by="fingerprint")

    def list_effects(self, scope: Operation, since, until):
        """Every listed item in [since, until] (by `effect_time`, when the items show
        one), read as `scope`'s account: the listing with `{since}` the range's start (a
        `listing` function sees it as `scope.created_at`)."""
        query: dict[str, Any] = {"method": "list_effects", "limit": self.limit,
                                 "since": since.isoformat(), "until": until.isoformat()}
        _, items = self._listing(scope, since.isoformat(), query)
        effects = []
        for item in items:
            at = None
            if self.effect_time is not None:
                try:
                    raw = _kit.extract(self.effect_time, item)
                    at = raw if isinstance(raw, datetime) else datetime.fromisoformat(str(raw))
                except (KeyError, TypeError, ValueError) as exc:
                    raise LookupFailed(f"expected each item to show when it happened at "
                                       f"effect_time ({exc})") from None
                if not since <= at <= until:
                    continue
            effects.append({"external_id": self._id(item), "idempotency_key": self._key(item),
                            "at": at.isoformat() if at else None,
                            "item": _kit.observed_body(item)})
        return reconcile.Effects(effects, complete=len(items) < self.limit, query=query)

    def _listing(self, op: Operation, since: str, query: dict[str, Any]) -> tuple[Any, list]:
        """(the answer, its items): `listing(op, limit)` or a GET of `url` with `since`;
        `query` gains what was asked."""
        if self.listing is not None:
            query["listing"] = getattr(self.listing, "__qualname__", repr(self.listing))[:200]
            body = self.listing(op, self.limit)
        else:
            url = _kit.fill(self.url, op, limit=self.limit, since=since)
            query["request"] = f"GET {_kit.shown_url(url)}"
            status, body = _kit.get(url, headers=self.headers, op=op, timeout=self.timeout,
                                    client=self.client)
            if status != 200:
                raise LookupFailed(f"expected 200 from {query['request']}, found {status}: "
                                   f"{scrub_text(str(body))[:300]}")
        try:
            items = _kit.pluck(body, self.items)
        except KeyError as exc:
            raise LookupFailed(f"expected a list of items in the listing ({exc})") from None
        if not isinstance(items, list):
            raise LookupFailed(f"expected the listing to be a list of items, "
                               f"found {type(items).__name__}")
        return body, items

    def _wanted(self, op: Operation) -> dict[str, Any]:
        wanted = {}
        for intent_path, _ in self.match:
            try:
                value = _kit.pluck(op.intent or {}, intent_path)
            except KeyError:
                raise InvalidInput(f"expected the intent of {op.operation_id} to have "
                                   f"{intent_path!r} to match on, found none") from None
            if value == REDACTED:
                raise InvalidInput(f"expected {intent_path!r} of the intent to match on, found "
                                   "it redacted: match on fields that are stored")
            wanted[intent_path] = value
        return wanted

    def _matches(self, item: Any, wanted: dict[str, Any]) -> bool:
        for intent_path, item_path in self.match:
            try:
                if _kit.pluck(item, item_path) != wanted[intent_path]:
                    return False
            except KeyError:
                return False
        return True

    def _id(self, item: Any) -> str:
        try:
            found = _kit.extract(self.external_id, item)
        except (KeyError, TypeError) as exc:
            raise LookupFailed(f"expected a matching item to carry its id ({exc})") from None
        if found in (None, ""):
            raise LookupFailed(f"expected an id on the matching item, found {found!r}")
        return str(found)

    def _key(self, item: Any) -> str | None:
        """The idempotency key a listed item carries, or None when it shows none."""
        return _kit.optional_key(self.idempotency_key, item)

    def _attributed_elsewhere(self, op: Operation, matches: list[Any]) -> set[str]:
        """Ids of matches another operation of the same name and provider account already
        owns: not this one's. Ids are the account's: another account's item of the same
        id is another item."""
        if not (self.exclude_attributed and matches):
            return set()
        ids = [self._id(m) for m in matches]
        return set(
            Operation.objects.filter(tenant=op.tenant, operation=op.operation,
                                     account=op.account, external_id__in=ids)
            .exclude(pk=op.pk).values_list("external_id", flat=True)
        )


def list_and_match(
    operation: str | None,
    *,
    match: Iterable[str] | Mapping[str, str],
    url: str | Callable[[Operation], str] | None = None,
    listing: Callable[[Operation, int], Any] | None = None,
    items: str = "",
    limit: int = 50,
    external_id: str | Callable[[Any], Any] = "id",
    since_margin: timedelta = timedelta(minutes=1),
    consistent_as_of: str | Callable[[Any], Any] | None = None,
    exclude_attributed: bool = True,
    headers: Mapping[str, str] | Callable[[Operation], Mapping[str, str]] | None = None,
    timeout: float = 5.0,
    client: Any = None,
    name: str = "",
    idempotency_key: str | Callable[[Any], Any] | None = "idempotency_key",
    keys: bool = True,
    trusted_absence: str = "",
    canary: dict[str, Any] | Callable[[Operation], dict[str, Any] | None] | None = None,
    effect_time: str | Callable[[Any], Any] | None = None,
    **tuning: Any,
) -> type[ListAndMatch]:
    """A reconciler that lists at most `limit` recent items and matches them on the intent.

    The items: `listing(op, limit)` (a callable returning them, or a JSON body holding
    them), or a GET of `url`, a template that may also name `{limit}` and `{since}` (the
    operation's creation time less `since_margin`, ISO 8601); `items` is the dotted path to
    the list in the answer ("" when the answer is the list). `match`: intent field names
    compared with the item's fields of the same names, or a mapping {intent path: item
    path}; the fields must survive redaction. Matches that another operation of the same
    name already names as its external id are left out (`exclude_attributed`).
    Verdicts: a listing of `limit` items or more hit its bound -> Ambiguous (never proof of
    absence); one match -> Found (id by `external_id`, a path or callable of the item);
    several -> Ambiguous with the matches (the operation is flagged "several matches");
    none -> ProvenAbsent, or NotYet when `consistent_as_of` shows the read predates the
    submission. Keys: `idempotency_key` (a path or callable of an item; None: items show
    none) is the key an item carries; the one match under the operation's own key is
    Found (by idempotency_key) whatever else matches, and a lone match under another key,
    or under none, is Ambiguous (made another way: a person decides, both ids in the
    evidence). `keys=False`: the service has no keys; content alone decides.
    An empty match proves absence only when the same listing, read for a positive control
    (the latest succeeded operation on the target, or `canary`, with the intent to match
    on), finds it (`reconcile.check_absence`); a listing that always answers `[]` is blind.
    With no control yet, only if `trusted_absence` says why (rarely true of a listing).
    Registered for `operation` unless it is None (to serve as the `search=` of
    `http_lookup`).

    The same listing serves `ledger.coverage` (`list_effects`: the target's effects no
    receipt explains); `effect_time` (a path or callable of an item giving when it
    happened, ISO 8601) keeps only the items in the range asked.
    """
    if (url is None) == (listing is None):
        raise InvalidInput(f"expected exactly one of url= and listing=, found url={url!r}, "
                           f"listing={listing!r}")
    if url is not None:
        _kit.check_template(url, "url", extra=("limit", "since"))
    if listing is not None and not callable(listing):
        raise InvalidInput(f"expected listing to be a callable (op, limit), found {listing!r}")
    pairs = tuple(match.items()) if isinstance(match, Mapping) else tuple(
        (field, field) for field in ([match] if isinstance(match, str) else match))
    if not pairs or not all(isinstance(a, str) and a and isinstance(b, str) and b
                            for a, b in pairs):
        raise InvalidInput(f"expected match to name at least one intent field, found {match!r}")
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 10_000:
        raise InvalidInput(f"expected limit to be an integer from 1 to 10000, found {limit!r}")
    if not isinstance(items, str):
        raise InvalidInput(f"expected items to be a dotted path, found {items!r}")
    if not isinstance(since_margin, timedelta) or since_margin < timedelta(0):
        raise InvalidInput(f"expected since_margin to be a timedelta of zero or more, "
                           f"found {since_margin!r}")
    _kit.check_extractor(external_id, "external_id")
    if idempotency_key is not None:
        _kit.check_extractor(idempotency_key, "idempotency_key")
    if consistent_as_of is not None:
        _kit.check_extractor(consistent_as_of, "consistent_as_of")
    if effect_time is not None:
        _kit.check_extractor(effect_time, "effect_time")
    shown = _kit.shown_url(str(url)) if url is not None else getattr(listing, "__qualname__", "")
    label = name or f"{operation or 'search'} (list_and_match {shown})"

    def wrap(value):
        return staticmethod(value) if callable(value) else value

    return _kit.build(ListAndMatch, operation, label[:200], {
        "url": wrap(url), "listing": wrap(listing), "items": items, "limit": limit,
        "match": pairs, "external_id": wrap(external_id), "since_margin": since_margin,
        "consistent_as_of": wrap(consistent_as_of), "exclude_attributed": exclude_attributed,
        "headers": wrap(headers), "timeout": float(timeout), "client": client,
        "idempotency_key": wrap(idempotency_key), "service_has_keys": _kit.check_keys(keys),
        "effect_time": wrap(effect_time),
        **_kit.control_attrs(trusted_absence, canary),
    }, tuning)
