"""`Ledger`: the ledger's agent API over HTTP, and `@ledger.action`, the decorator that makes
a function's external side effect happen at most once per idempotency key.

One lifecycle is two requests: the intent and its submission together
(`POST /api/v1/operations` with `submit: true`), then the outcome. Each flow below is
written once, as a generator of steps (a request, a pause, the call itself) that a sync
and an async driver carry out, so `def` and `async def` actions behave alike.

What happens when the ledger cannot be reached:
- before the call (intent or submission not acknowledged): the request carries a
  `Request-Id` of this call and is sent again, a few times (INTENT_RETRY_DELAYS); a
  submission it made whose answer was lost is answered again (`request_repeated`), so
  the call is made once. Still unanswered: the function is NOT called; LedgerUnavailable.
  (If the submission did land, the operation waits in `submitted` and the ledger's sweep
  hands it to reconciliation, which proves the call absent.)
- after the call: its outcome is recorded again with the same expected version, with
  backoff, for up to `record_for` seconds; the function is never called again. Still
  unrecorded: OutcomeNotRecorded (the value on `.value`); the operation stays submitted
  and the sweep turns it into outcome_unknown, as for a crashed sender.
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import inspect
import math
import os
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from urllib.parse import quote

from ledger_client import errors, tracing
from ledger_client._http import AsyncTransport, Request, SyncTransport
from ledger_client.receipt import Receipt

OPERATIONS = "/api/v1/operations"
RETRY_POLICIES = ("never", "if_absent_proven")
MAX_KEY = 200
# Pauses before sending the intent again after its answer was lost (same Request-Id).
INTENT_RETRY_DELAYS = (0.1, 0.5, 1.0)


@dataclass(frozen=True)
class _Sleep:
    seconds: float


_CALL = object()  # the step "call the function now"


# --- where a call runs ---------------------------------------------------------------------


@dataclass
class _Scope:
    run_id: str
    step_id: str
    fencing_token: int | None
    calls: dict[str, int] = field(default_factory=dict)


_scope: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar(
    "ledger_client_step", default=None)


class _StepScope:
    """`with ledger.step(run_id, step_id, fencing_token=...):` (or `async with`)."""

    def __init__(self, run_id: str, step_id: str, fencing_token: int | None):
        for name, value in (("run_id", run_id), ("step_id", step_id)):
            if not isinstance(value, str) or not value:
                raise errors.InvalidInput(f"expected {name} to be a non-empty string, found "
                                          f"{value!r}")
        if fencing_token is not None and (isinstance(fencing_token, bool)
                                          or not isinstance(fencing_token, int)):
            raise errors.InvalidInput(f"expected fencing_token to be an int or None, found "
                                      f"{fencing_token!r}")
        self.scope = _Scope(run_id, step_id, fencing_token)
        self._tokens: list[contextvars.Token] = []

    def __enter__(self) -> _Scope:
        self._tokens.append(_scope.set(self.scope))
        return self.scope

    def __exit__(self, *exc) -> None:
        _scope.reset(self._tokens.pop())

    async def __aenter__(self) -> _Scope:
        return self.__enter__()

    async def __aexit__(self, *exc) -> None:
        self.__exit__(*exc)


def step_key(run_id: str, step_id: str, call: str | None = None) -> str:
    """The idempotency key the ledger derives for a step's call (`receipts.idempotency_key`):
    `run:<run_id>/step:<step_id>[/call:<call>]`, each part percent-encoded; above 200
    characters `run-step:sha256:<hex>` of that text."""
    parts = [f"run:{quote(run_id, safe='')}", f"step:{quote(step_id, safe='')}"]
    if call is not None:
        parts.append(f"call:{quote(call, safe='')}")
    key = "/".join(parts)
    if len(key) > MAX_KEY:
        key = f"run-step:sha256:{hashlib.sha256(key.encode()).hexdigest()}"
    return key


# --- the client ------------------------------------------------------------------------------


class Ledger:
    """A connection to one ledger with one agent key.

    `url` and `key` default to the environment's LEDGER_URL and LEDGER_AGENT_KEY.
    `timeout`: seconds per request. `record_for`: seconds to keep trying to record an
    outcome after the call. `tenant`: the default tenant of actions (None: the key's only
    tenant). `transport` / `async_transport`: httpx transports (tests, proxies).
    """

    def __init__(self, url: str | None = None, *, key: str | None = None,
                 tenant: str | None = None, timeout: float = 10.0, record_for: float = 30.0,
                 approval_poll: float = 1.0, transport=None, async_transport=None):
        url = url if url is not None else os.environ.get("LEDGER_URL")
        key = key if key is not None else os.environ.get("LEDGER_AGENT_KEY")
        if not url:
            raise errors.ConfigurationError(
                "expected the ledger's URL (Ledger(url) or LEDGER_URL), found none")
        if not key:
            raise errors.ConfigurationError(
                "expected an agent key (Ledger(url, key=...) or LEDGER_AGENT_KEY), found none")
        self.url = url.rstrip("/")
        self.tenant = tenant
        self.record_for = record_for
        self.approval_poll = approval_poll
        self._sync = SyncTransport(self.url, key, timeout=timeout, transport=transport)
        self._async = AsyncTransport(self.url, key, timeout=timeout, transport=async_transport)

    def __repr__(self) -> str:  # never the key
        return f"<Ledger {self.url}>"

    # lifecycle of the client itself
    def close(self) -> None:
        self._sync.close()

    async def aclose(self) -> None:
        await self._async.aclose()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def __aenter__(self) -> Ledger:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
        self.close()

    # --- drivers: carry out a flow's steps -------------------------------------------------

    def _run(self, flow, call: Callable[[], Any] | None = None) -> Any:
        value, thrown = None, None
        while True:
            try:
                step = flow.throw(thrown) if thrown is not None else flow.send(value)
            except StopIteration as stop:
                return stop.value
            value, thrown = None, None
            try:
                if step is _CALL:
                    value = call()
                elif isinstance(step, _Sleep):
                    time.sleep(step.seconds)
                else:
                    value = self._sync.send(step)
            except BaseException as exc:  # noqa: BLE001 - handed to the flow, which decides
                thrown = exc

    async def _arun(self, flow, call: Callable[[], Any] | None = None) -> Any:
        import asyncio

        value, thrown = None, None
        while True:
            try:
                step = flow.throw(thrown) if thrown is not None else flow.send(value)
            except StopIteration as stop:
                return stop.value
            value, thrown = None, None
            try:
                if step is _CALL:
                    value = await call()
                elif isinstance(step, _Sleep):
                    await asyncio.sleep(step.seconds)
                else:
                    value = await self._async.send(step)
            except BaseException as exc:  # noqa: BLE001 - as above
                thrown = exc

    # --- the decorator ---------------------------------------------------------------------

    def action(
        self,
        operation: str,
        *,
        target: str | Callable[..., str],
        key: Callable[..., str] | None = None,
        rejections: tuple[type[BaseException], ...] = (),
        external_id: Callable[[Any], Any] | None = None,
        tenant: str | Callable[..., str] | None = None,
        retry_policy: str = "if_absent_proven",
        redact: Iterable[str] = (),
        fingerprint_fields: Iterable[str] | None = None,
        keep: Iterable[str] | None = None,
        in_flight_for: float | timedelta | None = None,
        approval_timeout: float | None = None,
        approval_note: str = "",
        account: str | Callable[..., str] | None = None,
        wait: float | None = None,
    ):
        """Make a function's external side effect happen at most once per idempotency key,
        with `receipts.action`'s meaning, over the API.

        Per call: the intent (the bound arguments; `keep`: only those dotted paths leave
        the process) and its submission in one request; then by the operation's state:
        sent now -> call; the return value is recorded as succeeded with its `result`
        and returned; an exception in `rejections` -> rejected, any other ->
        outcome_unknown, both re-raised. Succeeded before -> the stored result, not called
        (UnstorableResult if none was stored); submitted (another caller is sending it) ->
        InFlight (a subclass of OutcomeUnknown; ask again after `.retry_after` s);
        outcome_unknown / reconciling / manual_review -> OutcomeUnknown; rejected or
        abandoned -> Rejected, not called. The receipt on those errors (`.operation`) and
        on the action's span says `replayed`.

        The key: inside `ledger.step(run_id, step_id)` derived from the run and step (the
        n-th call of one operation in the step is call "n"); otherwise `key(*args,
        **kwargs)`; neither is InvalidInput (a generated key would send again after a
        crash). `target`, `account` (the provider account the call acts as: a non-secret
        label the ledger's reconcilers read as) and `tenant` are values or functions of the
        call's arguments.

        Under an approval policy: ApprovalRequired (the intent recorded, nothing sent), or
        with `approval_timeout` (seconds) the client asks for approval (`approval_note`)
        and waits: approved -> sent; denied -> ApprovalDenied; no decision in time ->
        ApprovalRequired.

        `wait` (seconds, default none): a call that finds its key in flight asks again
        every `.retry_after` s for up to `wait` s and gets the other caller's outcome (the
        stored result, or its error, `receipt.replayed` true on the action's span), or,
        once reconciliation proved the earlier attempt absent, sends it; still in flight
        after `wait` s: InFlight.
        """
        spec = _Spec.declare(
            operation, target=target, key=key, rejections=rejections,
            external_id=external_id, tenant=tenant, retry_policy=retry_policy,
            redact=redact, fingerprint_fields=fingerprint_fields, keep=keep,
            in_flight_for=in_flight_for, approval_timeout=approval_timeout,
            approval_note=approval_note, account=account, wait=wait,
        )

        def decorate(fn):
            signature = inspect.signature(fn)
            is_async = inspect.iscoroutinefunction(fn)

            if is_async:
                @functools.wraps(fn)
                async def async_wrapper(*args, **kwargs):
                    prepared = spec.prepare(self, signature, args, kwargs)
                    with tracing.action_span(operation) as span:
                        return await self._arun(
                            self._lifecycle(spec, prepared, span),
                            lambda: fn(*args, **kwargs))

                async def areceipt(*args, **kwargs) -> Receipt | None:
                    return await self._arun(self._find(spec, signature, args, kwargs))

                wrapper = async_wrapper
                wrapper.receipt = areceipt
            else:
                @functools.wraps(fn)
                def sync_wrapper(*args, **kwargs):
                    prepared = spec.prepare(self, signature, args, kwargs)
                    with tracing.action_span(operation) as span:
                        return self._run(self._lifecycle(spec, prepared, span),
                                         lambda: fn(*args, **kwargs))

                def receipt(*args, **kwargs) -> Receipt | None:
                    return self._run(self._find(spec, signature, args, kwargs))

                wrapper = sync_wrapper
                wrapper.receipt = receipt
            wrapper.receipt.__doc__ = (
                "The receipt of this call (same arguments: same key), or None if it was "
                "never recorded. Never records or sends anything.")
            wrapper.operation_name = operation
            return wrapper

        return decorate

    # --- the flows -------------------------------------------------------------------------

    def _lifecycle(self, spec: _Spec, prepared: _Prepared, span):
        body = {**prepared.body, "submit": True}
        ids = span.ids()  # the operation is linked to this span's trace
        headers = {"Request-Id": new_request_id()}
        if ids:
            headers["traceparent"] = f"00-{ids[0]}-{ids[1]}-01"
        try:
            data = yield from self._intent(Request("POST", OPERATIONS, body, headers=headers),
                                           wait=spec.wait)
        except errors.ApprovalRequired as exc:
            if spec.approval_timeout is None or exc.operation is None:
                raise
            data = yield from self._await_approval(spec, prepared, exc.operation)
        receipt = Receipt(data)
        span.record(receipt)
        if not data.get("submitted_now"):
            return _settled(receipt)
        marks = {"expected_version": receipt.version,
                 "fencing_token": prepared.fencing_token}
        try:
            value = yield _CALL
        except BaseException as exc:
            rejected = bool(spec.rejections) and isinstance(exc, spec.rejections)
            code, detail = _failure_record(exc)
            try:
                final = yield from self._record(
                    receipt, "rejected" if rejected else "outcome_unknown",
                    {**marks, "error_code": code, "detail": detail})
                span.record(final)
            except errors.OutcomeNotRecorded as failure:
                exc.add_note(str(failure))
                final = receipt  # submitted: the ledger's sweep hands it to reconciliation
            _attach(exc, final)
            raise
        payload: dict[str, Any] = {**marks, "external_id": _external_id(spec.external_id,
                                                                        value)}
        why = _not_json(value, "result")
        if why:
            payload["result_unstorable"] = why[:300]
        else:
            payload["result"] = value
        final = yield from self._record(receipt, "succeeded", payload, value=value)
        span.record(final)
        if final.result_unstorable:
            raise errors.UnstorableResult(
                f"expected the return value of {spec.operation} to be storable JSON, found "
                f"{final.result_unstorable}; operation {final.operation_id} is recorded as "
                "succeeded without its result; the value is on this error's .value",
                operation=final, value=value)
        return value

    def _intent(self, request: Request, *, wait: float | None = None):
        """The intent request's answer; sent again with the same `Request-Id` after a lost
        answer (a timeout, a dropped connection): a submission the lost one made is
        answered again, so nothing is left looking sent that this call did not send.
        `wait`: seconds to keep asking while another caller has the key in flight."""
        lost = iter(INTENT_RETRY_DELAYS)
        deadline = None if not wait else time.monotonic() + wait
        while True:
            try:
                return (yield request)
            except errors.LedgerUnavailable as exc:
                delay = next(lost, None)
                if delay is None or _never_reached(exc):
                    raise
            except errors.InFlight as exc:
                remaining = 0.0 if deadline is None else deadline - time.monotonic()
                if remaining <= 0:
                    raise
                delay = min(exc.retry_after, remaining)
            yield _Sleep(delay)

    def _record(self, receipt: Receipt, outcome: str, payload: dict, *, value: Any = None):
        """Record the call's outcome, again and again with the same expected version until
        the ledger has it or `record_for` has passed (OutcomeNotRecorded). A repeat that
        finds the outcome already there (its first try landed unanswered) is success."""
        path = f"{OPERATIONS}/{receipt.operation_id}/{outcome.replace('_', '-')}"
        deadline = time.monotonic() + self.record_for
        delay = 0.05
        while True:
            try:
                try:
                    return Receipt((yield Request("POST", path, payload)))
                except (errors.StaleVersion, errors.IllegalTransition) as exc:
                    # It moved on: an earlier try that landed unanswered, or the sweep.
                    current = Receipt((yield Request(
                        "GET", f"{OPERATIONS}/{receipt.operation_id}")))
                    if current.state != outcome:
                        raise errors.OutcomeNotRecorded(
                            f"expected operation {receipt.operation_id} still submitted to "
                            f"record it {outcome}, found it {current.state}: the call was "
                            "made and is not made again", operation=current, value=value,
                            cause=exc) from None
                    return current
            except errors.OutcomeNotRecorded:
                raise
            except errors.LedgerUnavailable as exc:
                if time.monotonic() + delay > deadline:
                    raise errors.OutcomeNotRecorded(
                        f"expected the ledger to record operation {receipt.operation_id} "
                        f"{outcome} within {self.record_for:g} s, found it unreachable "
                        f"({exc}); the call was made and is not made again: the operation "
                        "stays submitted until the ledger's sweep hands it to "
                        "reconciliation", operation=receipt, value=value, cause=exc) from None
                yield _Sleep(delay)
                delay = min(delay * 2, 2.0)

    def _await_approval(self, spec: _Spec, prepared: _Prepared, receipt: Receipt):
        """Ask for approval, wait for the decision; the submitted operation's data."""
        path = f"{OPERATIONS}/{receipt.operation_id}"
        yield Request("POST", f"{path}/approval-request", {"note": spec.approval_note})
        deadline = time.monotonic() + spec.approval_timeout
        while True:
            data = yield Request("GET", path)
            status = data.get("approval", {}).get("status")
            if status == "denied":
                reason = data["approval"].get("denied_reason")
                raise errors.ApprovalDenied(
                    f"expected operation {receipt.operation_id} approved, found it denied: "
                    f"{reason}", status=409, operation=Receipt(data),
                    problem={"reason": reason, "detail": "denied"})
            if data["state"] != "planned":
                return {**data, "submitted_now": False}
            if status in ("approved", "not_required"):
                submit = {"expected_version": data["version"],
                          "fencing_token": prepared.fencing_token,
                          "in_flight_seconds": spec.in_flight_seconds}
                try:
                    data = yield Request("POST", f"{path}/submitted", submit)
                except errors.StaleVersion:
                    return {**(yield Request("GET", path)), "submitted_now": False}
                return {**data, "submitted_now": True}
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                approval = data.get("approval", {})
                raise errors.ApprovalRequired(
                    f"expected a decision on operation {receipt.operation_id} within "
                    f"{spec.approval_timeout:g} s, found none ({approval.get('live')} of "
                    f"{approval.get('needed')} approvals); it is recorded and not sent",
                    status=409, operation=Receipt(data),
                    problem={"approvals_needed": approval.get("needed"),
                             "approvals_live": approval.get("live")})
            yield _Sleep(min(self.approval_poll, remaining))

    def _find(self, spec: _Spec, signature, args, kwargs):
        key, tenant = spec.lookup(self, signature, args, kwargs)
        params = {"operation": spec.operation, "idempotency_key": key, "limit": 1}
        if tenant is not None:
            params["tenant"] = tenant
        page = yield Request("GET", OPERATIONS, params=params)
        items = page.get("items") if isinstance(page, dict) else None
        if not isinstance(items, list):
            raise errors.UnexpectedResponse(f"expected a page of operations, found {page!r:.200}")
        return Receipt(items[0]) if items else None

    # --- the rest of the agent API ---------------------------------------------------------

    def step(self, run_id: str, step_id: str, *, fencing_token: int | None = None):
        """Actions called inside belong to the run's step: their keys derive from it (a
        step re-run after a crash finds its receipts) and `fencing_token` (from `resume`)
        fences every write. Works with `with` and `async with`; each asyncio task sees
        its own scope."""
        return _StepScope(run_id, step_id, fencing_token)

    def record(self, operation: str, *, target: str, intent: dict[str, Any],
               idempotency_key: str | None = None, tenant: str | None = None,
               run: str | None = None, step: str | None = None, call: str | None = None,
               retry_policy: str = "if_absent_proven", redact: Iterable[str] = (),
               fingerprint_fields: Iterable[str] | None = None,
               keep: Iterable[str] | None = None, account: str | None = None) -> Receipt:
        """Record an intent without submitting it (`receipts.record_intent` over the API):
        the planned operation, or the existing one of the same key and intent
        (`.replayed` true, its state as it stands: do not send unless it is planned or
        safe_to_retry). Mark it with `POST /api/v1/operations/{id}/submitted` etc., or
        let an action of the same key send it. IdempotencyKeyReused for another intent."""
        return Receipt(self._sync.send(self._record_request(
            operation, target, intent, idempotency_key, tenant, run, step, call,
            retry_policy, redact, fingerprint_fields, keep, account)))

    async def arecord(self, operation: str, *, target: str, intent: dict[str, Any],
                      idempotency_key: str | None = None, tenant: str | None = None,
                      run: str | None = None, step: str | None = None,
                      call: str | None = None, retry_policy: str = "if_absent_proven",
                      redact: Iterable[str] = (),
                      fingerprint_fields: Iterable[str] | None = None,
                      keep: Iterable[str] | None = None,
                      account: str | None = None) -> Receipt:
        return Receipt(await self._async.send(self._record_request(
            operation, target, intent, idempotency_key, tenant, run, step, call,
            retry_policy, redact, fingerprint_fields, keep, account)))

    def _record_request(self, operation, target, intent, idempotency_key, tenant, run,
                        step, call, retry_policy, redact, fingerprint_fields, keep,
                        account=None) -> Request:
        if not isinstance(intent, dict):
            raise errors.InvalidInput(f"expected intent to be a dict, found "
                                      f"{type(intent).__name__}")
        why = _not_json(intent, "intent")
        if why:
            raise errors.InvalidInput(f"expected the intent of {operation} to be JSON, found "
                                      f"{why}; nothing was recorded")
        if retry_policy not in RETRY_POLICIES:
            raise errors.InvalidInput(f"expected retry_policy in {list(RETRY_POLICIES)}, "
                                      f"found {retry_policy!r}")
        body: dict[str, Any] = {"operation": operation, "target": target, "intent": intent,
                                "retry_policy": retry_policy,
                                "redact": list(_paths(redact, "redact"))}
        for name, value in (("idempotency_key", idempotency_key),
                            ("tenant", tenant or self.tenant), ("run", run), ("step", step),
                            ("call", call), ("account", account)):
            if value is not None:
                body[name] = value
        if fingerprint_fields is not None:
            body["fingerprint_fields"] = list(_paths(fingerprint_fields,
                                                     "fingerprint_fields"))
        if keep is not None:
            body["keep"] = list(_paths(keep, "keep"))
        return Request("POST", OPERATIONS, body)

    def operation(self, operation_id: str) -> Receipt:
        """The receipt with its events, evidence and approval status."""
        return Receipt(self._sync.send(Request("GET", f"{OPERATIONS}/{operation_id}")))

    async def aoperation(self, operation_id: str) -> Receipt:
        return Receipt(await self._async.send(Request("GET", f"{OPERATIONS}/{operation_id}")))

    def retries_due(self, *, operation: str | None = None,
                    tenant: str | None = None) -> list[Receipt]:
        """The operations waiting in safe_to_retry, oldest first. The ledger never sends
        them: call the action again with the same arguments (same key) to send attempt+1."""
        return self._run(self._retries_due(operation, tenant))

    async def aretries_due(self, *, operation: str | None = None,
                           tenant: str | None = None) -> list[Receipt]:
        return await self._arun(self._retries_due(operation, tenant))

    def _retries_due(self, operation, tenant):
        params: dict[str, Any] = {"state": "safe_to_retry", "limit": 200}
        for name, value in (("operation", operation), ("tenant", tenant)):
            if value is not None:
                params[name] = value
        found: list[Receipt] = []
        while True:
            page = yield Request("GET", OPERATIONS, params=params)
            found.extend(Receipt(item) for item in page["items"])
            if not page.get("next_cursor"):
                break
            params["cursor"] = page["next_cursor"]
        found.sort(key=lambda r: (r.state_changed_at or "", r.operation_id))
        return found

    def resume(self, run_id: str, *, worker: str, ttl_seconds: float | None = None,
               tenant: str | None = None) -> Receipt:
        """Take over the run (its lease, as `<key name>/<worker>`) and get its hand-off
        view: `.token` (pass it to `step(..., fencing_token=)`), `.steps`,
        `.open_operations` (each with its `next_moves`, `approval` and `relied_on`),
        `.pending_obligations`, `.facts`. LeaseHeld while another worker holds it.
        `tenant` (default: the client's): the run's, run ids being unique per tenant."""
        with tracing.state_span("run_resume") as span:
            view = Receipt(self._sync.send(self._resume(run_id, worker, ttl_seconds, tenant)))
            span.set(_resume_attributes(run_id, worker, view))
            return view

    async def aresume(self, run_id: str, *, worker: str, ttl_seconds: float | None = None,
                      tenant: str | None = None) -> Receipt:
        with tracing.state_span("run_resume") as span:
            view = Receipt(await self._async.send(
                self._resume(run_id, worker, ttl_seconds, tenant)))
            span.set(_resume_attributes(run_id, worker, view))
            return view

    def _resume(self, run_id: str, worker: str, ttl_seconds: float | None,
                tenant: str | None) -> Request:
        body: dict[str, Any] = {"worker": worker}
        if ttl_seconds is not None:
            body["ttl_seconds"] = ttl_seconds
        return Request("POST", f"/api/v1/runs/{quote(run_id, safe='')}/resume", body,
                       params=self._tenant_param(tenant))

    def _tenant_param(self, tenant: str | None) -> dict[str, str] | None:
        """`?tenant=` for a path naming a run: the one given, else the client's."""
        tenant = tenant or self.tenant
        return {"tenant": tenant} if tenant else None

    def start_run(self, objective: str, *, run_id: str | None = None,
                  tenant: str | None = None) -> Receipt:
        """Start a run (idempotent on run_id)."""
        body = {"objective": objective, "run_id": run_id, "tenant": tenant or self.tenant}
        return Receipt(self._sync.send(Request("POST", "/api/v1/runs", body)))

    def add_step(self, run_id: str, step_id: str, *, depends_on: Iterable[str] = (),
                 tenant: str | None = None, fencing_token: int | None = None) -> Receipt:
        """Add a step to a run (idempotent); `tenant` as for `resume`. Once the run is
        leased, pass its `fencing_token` (`resume(...).token`): without it, or with an
        older one, StaleFencingToken and nothing is added."""
        body: dict[str, Any] = {"step_id": step_id, "depends_on": list(depends_on)}
        if fencing_token is not None:
            body["fencing_token"] = fencing_token
        return Receipt(self._sync.send(
            Request("POST", f"/api/v1/runs/{quote(run_id, safe='')}/steps", body,
                    params=self._tenant_param(tenant))))


# --- a declared action -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Prepared:
    body: dict[str, Any]
    fencing_token: int | None


@dataclass(frozen=True)
class _Spec:
    operation: str
    target: Any
    key: Callable | None
    rejections: tuple
    external_id: Callable | None
    tenant: Any
    retry_policy: str
    redact: tuple[str, ...]
    fingerprint_fields: tuple[str, ...] | None
    keep: tuple[str, ...] | None
    in_flight_seconds: float | None
    approval_timeout: float | None
    approval_note: str
    account: Any = None
    wait: float | None = None

    @classmethod
    def declare(cls, operation, *, target, key, rejections, external_id, tenant,
                retry_policy, redact, fingerprint_fields, keep, in_flight_for,
                approval_timeout, approval_note, account=None, wait=None) -> _Spec:
        """Checked once, where the action is declared: a malformed one fails at import."""
        if not isinstance(operation, str) or not operation:
            raise errors.InvalidInput(f"expected an operation name, found {operation!r}")
        for name, value in (("target", target), ("tenant", tenant), ("account", account)):
            if value is not None and not callable(value) and not isinstance(value, str):
                raise errors.InvalidInput(f"expected {name}= to be a string or a function of "
                                          f"the call's arguments, found {value!r}")
        if target is None:
            raise errors.InvalidInput("expected target= (a string or a function), found None")
        for name, value in (("key", key), ("external_id", external_id)):
            if value is not None and not callable(value):
                raise errors.InvalidInput(f"expected {name}= to be a function or None, found "
                                          f"{type(value).__name__}")
        if not isinstance(rejections, tuple) or not all(
                isinstance(r, type) and issubclass(r, BaseException) for r in rejections):
            raise errors.InvalidInput(f"expected rejections= to be a tuple of exception "
                                      f"classes, found {rejections!r}")
        if retry_policy not in RETRY_POLICIES:
            raise errors.InvalidInput(f"expected retry_policy in {list(RETRY_POLICIES)}, "
                                      f"found {retry_policy!r}")
        if isinstance(in_flight_for, timedelta):
            in_flight_for = in_flight_for.total_seconds()
        if approval_timeout is not None and (isinstance(approval_timeout, bool) or not
                                             isinstance(approval_timeout, int | float)
                                             or approval_timeout < 0):
            raise errors.InvalidInput(f"expected approval_timeout to be seconds or None, "
                                      f"found {approval_timeout!r}")
        if wait is not None and (isinstance(wait, bool) or not isinstance(wait, int | float)
                                 or not 0 <= wait < math.inf):
            raise errors.InvalidInput(f"expected wait to be seconds or None, found {wait!r}")
        return cls(
            operation=operation, target=target, key=key, rejections=rejections,
            external_id=external_id, tenant=tenant, retry_policy=retry_policy,
            redact=_paths(redact, "redact"),
            fingerprint_fields=(None if fingerprint_fields is None
                                else _paths(fingerprint_fields, "fingerprint_fields")),
            keep=None if keep is None else _paths(keep, "keep"),
            in_flight_seconds=in_flight_for, approval_timeout=approval_timeout,
            approval_note=approval_note, account=account, wait=wait,
        )

    def _value(self, name: str, value: Any, args, kwargs) -> str | None:
        if callable(value):
            value = value(*args, **kwargs)
            if value is not None and (not isinstance(value, str) or not value):
                raise errors.InvalidInput(f"expected {name}= of {self.operation} to return a "
                                          f"non-empty string, found {value!r}")
        return value

    def _key(self, args, kwargs, *, advance: bool) -> tuple[str | None, str | None,
                                                             _Scope | None]:
        """(idempotency key, call, scope). In a step the key is left to the ledger, which
        derives it; `advance`: count this call (a look-up does not: it names the last
        call made in the scope, or the first when none was)."""
        scope = _scope.get()
        if scope is not None:
            n = scope.calls.get(self.operation, 0)
            if advance:
                n = scope.calls[self.operation] = n + 1
            n = max(n, 1)
            return None, (str(n) if n > 1 else None), scope
        if self.key is None:
            raise errors.InvalidInput(
                f"expected a key for action {self.operation}: call it inside "
                "ledger.step(run_id, step_id) or give @ledger.action a key= function, found "
                "neither (a generated key would send again after a crash)")
        value = self.key(*args, **kwargs)
        if not isinstance(value, str | int) or isinstance(value, bool) or value == "":
            raise errors.InvalidInput(f"expected key= of {self.operation} to return a "
                                      f"non-empty string, found {value!r}")
        return str(value), None, None

    def prepare(self, ledger: Ledger, signature, args, kwargs) -> _Prepared:
        """The request of one call, checked before anything is sent."""
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise errors.InvalidInput(f"expected arguments {signature} for "
                                      f"{self.operation}, found: {exc}") from None
        bound.apply_defaults()
        intent = _intent_of(signature, bound)
        why = _not_json(intent, "intent")
        if why:
            raise errors.InvalidInput(f"expected the arguments of {self.operation} to be "
                                      f"JSON, found {why}; nothing was sent")
        if self.keep is not None:
            intent = _kept(intent, self.keep)
        idem, call, scope = self._key(args, kwargs, advance=True)
        body: dict[str, Any] = {
            "operation": self.operation,
            "target": self._value("target", self.target, args, kwargs),
            "intent": intent,
            "retry_policy": self.retry_policy,
            "redact": list(self.redact),
        }
        tenant = self._value("tenant", self.tenant, args, kwargs) or ledger.tenant
        if tenant is not None:
            body["tenant"] = tenant
        account = self._value("account", self.account, args, kwargs)
        if account:
            body["account"] = account
        if self.fingerprint_fields is not None:
            body["fingerprint_fields"] = list(self.fingerprint_fields)
        if scope is not None:
            body.update(run=scope.run_id, step=scope.step_id)
            if call is not None:
                body["call"] = call
        else:
            body["idempotency_key"] = idem
        token = scope.fencing_token if scope is not None else None
        if token is not None:
            body["fencing_token"] = token
        if self.in_flight_seconds is not None:
            body["in_flight_seconds"] = self.in_flight_seconds
        return _Prepared(body, token)

    def lookup(self, ledger: Ledger, signature, args, kwargs) -> tuple[str, str | None]:
        """(idempotency key, tenant) of a call, for its receipt."""
        try:
            signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise errors.InvalidInput(f"expected arguments {signature} for "
                                      f"{self.operation}, found: {exc}") from None
        idem, call, scope = self._key(args, kwargs, advance=False)
        if scope is not None:
            idem = step_key(scope.run_id, scope.step_id, call)
        return idem, self._value("tenant", self.tenant, args, kwargs) or ledger.tenant


# --- helpers ---------------------------------------------------------------------------------


def _never_reached(exc: errors.LedgerUnavailable) -> bool:
    """The request could not connect (the transport already tried again): it reached
    nothing, so there is no lost answer to ask for."""
    import httpx

    return isinstance(exc.cause, httpx.ConnectError)


def new_request_id() -> str:
    """A `Request-Id` for one call's intent request: random, kept only by this call."""
    return f"req-{secrets.token_urlsafe(24)}"


def _settled(receipt: Receipt) -> Any:
    """What a call of a key that is not to be sent gets: the stored result or an error."""
    state = receipt.state
    if state == "succeeded":
        if receipt.data.get("result_unstorable"):
            raise errors.UnstorableResult(
                f"expected a stored result of operation {receipt.operation_id} "
                f"({receipt.operation}), found none: {receipt.result_unstorable}; it "
                f"succeeded (external id {receipt.external_id or 'none'}) and is not sent "
                "again", operation=receipt)
        return receipt.data.get("result")
    if state in ("rejected", "abandoned"):
        code = receipt.data.get("error_code")
        raise errors.Rejected(
            f"expected operation {receipt.operation_id} ({receipt.operation}, key "
            f"{receipt.idempotency_key}) to be sendable, found it {state}"
            + (f" with code {code}" if code else "") + "; it is not sent again",
            operation=receipt)
    if state == "submitted":  # another caller is sending it (a ledger without the 409)
        raise errors.InFlight(
            f"expected operation {receipt.operation_id} ({receipt.operation}, key "
            f"{receipt.idempotency_key}) planned, safe_to_retry or succeeded, found "
            "submitted: another caller is sending it now; it is not sent again, ask again "
            "shortly for its outcome", status=409, operation=receipt,
            problem={"type": errors.PROBLEM_PREFIX + errors.InFlight.slug,
                     "detail": "in flight", "retry_after": 1})
    raise errors.OutcomeUnknown(
        f"expected operation {receipt.operation_id} ({receipt.operation}, key "
        f"{receipt.idempotency_key}) planned, safe_to_retry or succeeded, found {state}: an "
        "earlier attempt was sent and its effect is not proven; it is not sent again until "
        "reconciliation or a person decides", operation=receipt)


def _paths(paths: Iterable[str], name: str) -> tuple[str, ...]:
    if isinstance(paths, str):
        raise errors.InvalidInput(f"expected {name}= to be a list of dotted paths, found the "
                                  f"string {paths!r}")
    found = tuple(paths)
    for path in found:
        if not isinstance(path, str) or not path or any(not p for p in path.split(".")):
            raise errors.InvalidInput(f"expected {name}= to hold dotted paths, found {path!r}")
    return found


def _intent_of(signature: inspect.Signature, bound: inspect.BoundArguments) -> dict:
    """The canonical intent of a call, the one the TypeScript client records too: a
    function of one parameter given one mapping records that mapping itself (the shape of
    a tool's input: `publish({"slug": ...})` records `{"slug": ...}`, not
    `{"article": {...}}`); otherwise the arguments by name, `**kwargs` merged in. So a key
    recorded by one client is the same intent in the other (tests/clients/
    test_cross_language.py)."""
    params = list(signature.parameters.values())
    if len(params) == 1 and params[0].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                               inspect.Parameter.POSITIONAL_OR_KEYWORD):
        only = bound.arguments.get(params[0].name)
        if isinstance(only, dict):
            return dict(only)
    intent = dict(bound.arguments)
    for name, param in signature.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            intent.update(intent.pop(name))
    return intent


def _kept(intent: dict, paths: tuple[str, ...]) -> dict:
    """Only the fields at `paths` (dotted); the rest never leaves the process."""
    kept: dict = {}
    for path in paths:
        parts = path.split(".")
        source: Any = intent
        for part in parts:
            if not isinstance(source, dict) or part not in source:
                break
            source = source[part]
        else:
            into = kept
            for part in parts[:-1]:
                into = into.setdefault(part, {})
            into[parts[-1]] = source
    return kept


def _not_json(value: Any, what: str) -> str:
    """"" when `value` is JSON (dicts with string keys, lists, strings, finite numbers,
    booleans, None); else where and what it is not (`intent.items[3].n: a set`)."""
    stack: list[tuple[Any, str]] = [(value, what)]
    seen: set[int] = set()
    while stack:
        item, path = stack.pop()
        if item is None or isinstance(item, str | bool | int):
            continue
        if isinstance(item, float):
            if not math.isfinite(item):
                return f"{path}: {item!r} (not a finite number)"
            continue
        if isinstance(item, dict | list | tuple):
            if id(item) in seen:
                return f"{path}: a container that contains itself"
            seen.add(id(item))
            if isinstance(item, dict):
                for k, v in item.items():
                    if not isinstance(k, str):
                        return f"{path}: a key {k!r} that is not a string"
                    stack.append((v, f"{path}.{k}"))
            else:
                stack.extend((v, f"{path}[{i}]") for i, v in enumerate(item))
            continue
        return f"{path}: a {type(item).__name__}"
    return ""


def _external_id(extract: Callable | None, value: Any) -> str | None:
    if extract is None:
        return None
    try:
        found = extract(value)
        text = None if found is None else (found if isinstance(found, str) else str(found))
    except Exception:  # noqa: BLE001 - the effect happened; the id is a nicety
        return None
    text = text.strip()[:500] if text is not None else None
    return text or None


def _attach(exc: BaseException, receipt: Receipt) -> None:
    """The function's own exception, re-raised, carries the receipt as recorded
    (`exc.ledger_operation`), so `tool_message(exc)` can name the operation."""
    try:
        exc.ledger_operation = receipt
    except (AttributeError, TypeError):  # an exception class that refuses attributes
        pass


def _failure_record(exc: BaseException) -> tuple[str, str]:
    """(error_code, detail): the exception's class name and its message."""
    code = type(exc).__name__
    try:
        detail = str(exc)
    except Exception:  # noqa: BLE001 - a strange exception still gets recorded
        detail = f"<{code} whose message cannot be read>"
    return code, detail[:4000]


def _resume_attributes(run_id: str, worker: str, view: Receipt) -> dict[str, Any]:
    data = view.data
    return {"ledger.run_id": run_id, "ledger.worker": worker,
            "ledger.fencing_token": data.get("token"),
            "ledger.facts.read": tracing.fact_versions(data.get("facts")),
            "ledger.open_operations": len(data.get("open_operations") or ()),
            "ledger.pending_obligations": len(data.get("pending_obligations") or ())}
