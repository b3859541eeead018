"""Look-up through any function: a message stream, a mailbox, an SDK call, a database."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ledger import reconcile
from ledger.canonical import scrub_text
from ledger.errors import InvalidInput
from ledger.models import Operation
from ledger.reconcilers import _kit
from ledger.reconcilers.lookup import LookupFailed


class FunctionLookup(reconcile.Reconciler):
    """`find(op)` for the operation; built by `function_lookup`, whose arguments it carries."""

    find: Callable[[Operation], Any] | None = None
    external_id: str | Callable[[Any], Any] = "id"
    then: type[reconcile.Reconciler] | None = None

    def lookup(self, op: Operation):
        query = {"method": "lookup",
                 "function": getattr(self.find, "__qualname__", repr(self.find))[:200],
                 "idempotency_key": op.idempotency_key}
        found = self.find(op)
        if isinstance(found, reconcile.Verdict):
            return found  # the function decided itself (NotYet, Ambiguous, ...)
        if found is None:
            return reconcile.ProvenAbsent({"found": None}, query=query,
                                          matched_by="idempotency_key")
        observed = {"found": _kit.observed_body(found)}
        try:
            external = _kit.extract(self.external_id, found)
        except (KeyError, TypeError) as exc:
            raise LookupFailed(f"expected what {query['function']} found to carry the "
                               f"external id ({exc}), found "
                               f"{scrub_text(str(found))[:200]}") from None
        if external in (None, ""):
            raise LookupFailed(f"expected an external id in what {query['function']} found, "
                               f"found {external!r}")
        return reconcile.Found(str(external), observed, query=query,
                               matched_by="idempotency_key")

    def search(self, op: Operation):
        if self.then is None:
            return reconcile.Ambiguous(
                reason="the look-up could not decide and this reconciler has no search")
        return self.then().search(op)

    def absence_trusted_because(self, method: str) -> str:
        if method == "search":
            return self.then().absence_trusted_because(method) if self.then else ""
        return self.trusted_absence


def function_lookup(
    operation: str | None,
    *,
    find: Callable[[Operation], Any],
    external_id: str | Callable[[Any], Any] = "id",
    search: type[reconcile.Reconciler] | None = None,
    name: str = "",
    trusted_absence: str = "",
    canary: dict[str, Any] | Callable[[Operation], dict[str, Any] | None] | None = None,
    **tuning: Any,
) -> type[FunctionLookup]:
    """A reconciler that asks `find(op)` whether the operation's effect exists; registered
    for `operation` (unless None).

    `find(op)` returns what it found (a dict, an object: `external_id` takes the id from
    it, a dotted path or a callable) -> Found; None -> ProvenAbsent, so `find` must return
    None only when a complete read shows the effect is absent (a stream read to its end, a
    mailbox searched by the message id); or a verdict of its own
    (`reconcile.NotYet(...)`, `reconcile.Ambiguous(...)`, or None-like "cannot decide"
    by raising LookupFailed, a reconciler error the engine retries with backoff).
    What it found is recorded as evidence (large values as an excerpt). `search`: a
    reconciler (e.g. `list_and_match(None, listing=...)`) for when the look-up cannot
    decide. `tuning`: `grace_period`, `backoff_initial`, `backoff_max`, `lease_ttl`,
    `max_failures`. None proves absence only when `find` also finds a positive control
    (the latest succeeded operation on the target, or `canary`); with no control yet, only
    if `trusted_absence` says why (`reconcile.check_absence`).
    """
    if not callable(find):
        raise InvalidInput(f"expected find to be a function of the operation, found {find!r}")
    _kit.check_extractor(external_id, "external_id")
    if search is not None and not (isinstance(search, type)
                                   and issubclass(search, reconcile.Reconciler)):
        raise InvalidInput(f"expected search to be a reconciler class, found {search!r}")
    qualname = getattr(find, "__qualname__", "function")
    label = name or f"{operation or 'look-up'} (function_lookup {qualname})"
    return _kit.build(FunctionLookup, operation, label[:200], {
        "find": staticmethod(find),
        "external_id": staticmethod(external_id) if callable(external_id) else external_id,
        "then": search,
        **_kit.control_attrs(trusted_absence, canary),
    }, tuning)
