"""Look-up over HTTP by idempotency key or external id: 404 absent, 200 found."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ledger import reconcile
from ledger.canonical import scrub_text
from ledger.errors import InvalidInput
from ledger.models import Operation
from ledger.reconcilers import _kit


class LookupFailed(Exception):
    """The service answered neither 200 nor 404 (nor a fall-back status): no verdict.

    The engine records it as a reconciler error, tries again with backoff and, after
    `max_failures` in a row, hands the operation to a person.
    """


class HttpLookup(reconcile.Reconciler):
    """GET `url` for the operation; built by `http_lookup`, whose arguments it carries."""

    url: str | Callable[[Operation], str] = ""
    external_id: str | Callable[[Any], Any] = "id"
    headers: Mapping[str, str] | Callable[[Operation], Mapping[str, str]] | None = None
    timeout = 5.0
    fall_back_on: tuple[int, ...] = ()
    consistent_as_of: str | Callable[[Any], Any] | None = None
    then: type[reconcile.Reconciler] | None = None
    client: Any = None
    idempotency_key: str | Callable[[Any], Any] | None = None

    def lookup(self, op: Operation):
        needs = set() if callable(self.url) else _kit.template_fields(self.url)
        if "external_id" in needs and not op.external_id:
            return None  # nothing to look up by: the search (if any) decides
        matched_by = "external_id" if "external_id" in needs else "idempotency_key"
        url = _kit.fill(self.url, op)
        query = {"method": "lookup", "request": f"GET {_kit.shown_url(url)}"}
        status, body = _kit.get(url, headers=self.headers, op=op, timeout=self.timeout,
                                client=self.client)
        observed = {"status": status, "body": _kit.observed_body(body)}
        if status == 200:
            try:
                found = _kit.extract(self.external_id, body)
            except (KeyError, TypeError) as exc:
                raise LookupFailed(
                    f"expected the 200 answer of {query['request']} to carry the external id "
                    f"({exc}), found {scrub_text(str(body))[:200]}"
                ) from None
            if found in (None, ""):
                raise LookupFailed(f"expected an external id in the 200 answer of "
                                   f"{query['request']}, found {found!r}")
            return reconcile.Found(str(found), observed, query=query, matched_by=matched_by,
                                   idempotency_key=_kit.optional_key(self._key_spec(), body))
        if status == 404:
            why = _kit.not_visible_yet(op, body, self.consistent_as_of)
            if why:
                return reconcile.NotYet({**observed, "not_yet": why}, query=query)
            return reconcile.ProvenAbsent(observed, query=query, matched_by=matched_by)
        if status in self.fall_back_on:
            return None
        raise LookupFailed(
            f"expected 200 (found) or 404 (absent) from {query['request']}, found {status}: "
            f"{scrub_text(str(body))[:300]}"
        )

    def _key_spec(self) -> str | Callable[[Any], Any] | None:
        """Where the answer shows its idempotency key: `idempotency_key`, or by default
        beside the external id ("article.id" -> "article.idempotency_key")."""
        if self.idempotency_key is not None or callable(self.external_id):
            return self.idempotency_key
        parent = self.external_id.rpartition(".")[0]
        return f"{parent}.idempotency_key" if parent else "idempotency_key"

    def search(self, op: Operation):
        if self.then is None:
            return reconcile.Ambiguous(
                reason="the look-up could not decide and this reconciler has no search")
        return self.then().search(op)

    def absence_trusted_because(self, method: str) -> str:
        # The declaration covers the look-up; an absence the search saw is the search's.
        if method == "search":
            return self.then().absence_trusted_because(method) if self.then else ""
        return self.trusted_absence


def http_lookup(
    operation: str | None,
    *,
    url: str | Callable[[Operation], str],
    external_id: str | Callable[[Any], Any] = "id",
    headers: Mapping[str, str] | Callable[[Operation], Mapping[str, str]] | None = None,
    timeout: float = 5.0,
    fall_back_on: tuple[int, ...] = (),
    consistent_as_of: str | Callable[[Any], Any] | None = None,
    search: type[reconcile.Reconciler] | None = None,
    client: Any = None,
    name: str = "",
    idempotency_key: str | Callable[[Any], Any] | None = None,
    keys: bool = True,
    trusted_absence: str = "",
    canary: dict[str, Any] | Callable[[Operation], dict[str, Any] | None] | None = None,
    **tuning: Any,
) -> type[HttpLookup]:
    """A reconciler that reads one URL per operation; registered for `operation` (unless None).

    `url`: a template naming operation fields in braces (`{idempotency_key}`,
    `{external_id}`, `{operation_id}`, `{operation}`, `{tenant}`, percent-encoded; `{target}`
    as it is), or a callable `url(op)`. A template naming `{external_id}` is read only when
    the receipt has one; otherwise the look-up cannot decide and `search` runs.
    The answer: 200 -> Found, the id taken from the JSON body by `external_id` (a dotted
    path such as "article.id", or a callable of the body); 404 -> ProvenAbsent, or NotYet
    when `consistent_as_of` (a path or callable giving the time up to which the service's
    reads are complete) is earlier than the submission; a status in `fall_back_on` (say 501:
    the key index is down) -> the `search` reconciler decides (e.g. `list_and_match(None,
    ...)`); anything else, or a transport error -> LookupFailed, a reconciler error the
    engine retries with backoff. `headers` (a dict, or a callable of the operation, for
    credentials) are sent but never recorded. `client`: an `httpx.Client` to send with
    (transports, auth); by default a new one per look-up. `tuning`: `grace_period`,
    `backoff_initial`, `backoff_max`, `lease_ttl`, `max_failures`.
    `idempotency_key`: where a 200 answer shows the key of what it found (a path or
    callable; default: beside the external id, "article.idempotency_key" for
    "article.id"); an answer under another key than the operation's is Ambiguous, both ids
    in the evidence, unless `keys=False` (the service has no keys).
    A 404 proves absence only when the same look-up finds a positive control (the latest
    succeeded operation on the target, or `canary`: see `reconcile.check_absence`); with no
    control yet, only if `trusted_absence` says why a 404 is proof (say "the service
    answers 404 only for keys it never saw"), shown on the evidence.
    """
    _kit.check_template(url, "url")
    _kit.check_extractor(external_id, "external_id")
    if idempotency_key is not None:
        _kit.check_extractor(idempotency_key, "idempotency_key")
    if consistent_as_of is not None:
        _kit.check_extractor(consistent_as_of, "consistent_as_of")
    if not (isinstance(fall_back_on, tuple)
            and all(isinstance(s, int) and 100 <= s <= 599 for s in fall_back_on)):
        raise InvalidInput(f"expected fall_back_on to be a tuple of HTTP statuses, "
                           f"found {fall_back_on!r}")
    if search is not None and not (isinstance(search, type)
                                   and issubclass(search, reconcile.Reconciler)):
        raise InvalidInput(f"expected search to be a reconciler class (list_and_match(None, "
                           f"...)), found {search!r}")
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0:
        raise InvalidInput(f"expected timeout to be a positive number of seconds, "
                           f"found {timeout!r}")
    label = name or f"{operation or 'look-up'} (http_lookup {_kit.shown_url(str(url))})"
    return _kit.build(HttpLookup, operation, label[:200], {
        "url": staticmethod(url) if callable(url) else url,
        "external_id": staticmethod(external_id) if callable(external_id) else external_id,
        "headers": staticmethod(headers) if callable(headers) else headers,
        "timeout": float(timeout), "fall_back_on": fall_back_on,
        "consistent_as_of": (staticmethod(consistent_as_of) if callable(consistent_as_of)
                             else consistent_as_of),
        "then": search, "client": client,
        "idempotency_key": (staticmethod(idempotency_key) if callable(idempotency_key)
                            else idempotency_key),
        "service_has_keys": _kit.check_keys(keys),
        **_kit.control_attrs(trusted_absence, canary),
    }, tuning)
