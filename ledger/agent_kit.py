"""The agent integration kit: `@receipts.action`, the async twins, `retries_due`.

`action` wraps a function that has an external side effect so that each logical call sends
at most once per idempotency key: it records the intent (the call's bound arguments),
sends only from planned or safe_to_retry, stores the return value as `Operation.result` and
returns it. Every write goes through `ledger.receipts` / `ledger.transitions`.

How a call finds its key:
- inside `with receipts.step_scope(run, step_id, fencing_token=...):`, the key derives from
  the run and step (`record_intent(run=, step=, call=)`, `receipts.idempotency_key`);
  several calls of one operation in one step are told apart by their order in the scope
  (the first has no `call`, then call "2", "3", ...); the scope's token fences every write
  (required once the run is leased);
- otherwise from `key(*args, **kwargs)`;
- neither: InvalidInput before anything is recorded. A generated key would differ after a
  crash and the retried call would send a second time.

Async: the twins run each ledger write in Django's thread-sensitive worker thread
(`sync_to_async(thread_sensitive=True)`, as Django's own async ORM methods do): one whole
write, its durable transaction included, per hop, so the event loop never waits on
PostgreSQL and no transaction spans an await. All writes of a process share that thread's
one connection (a thread pool opens one connection per thread and, measured with 50
agents, stalled the loop longer through GIL contention).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import math
import time
from collections.abc import Callable, Iterable
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

from asgiref.sync import sync_to_async

from ledger import receipts, runs, states, tracing, transitions
from ledger.canonical import scrub_text
from ledger.errors import (
    InFlight,
    InvalidInput,
    LedgerError,
    OutcomeUnknown,
    Rejected,
    StaleVersion,
    UnstorableResult,
)
from ledger.inputs import (
    check_choice,
    check_identifier,
    check_json,
    check_operation_name,
    check_paths,
    check_string,
    storable,
)
from ledger.models import Operation, Run
from ledger.states import RetryPolicy, State

# --- where a call runs ---------------------------------------------------------------------


@dataclass
class _Scope:
    run: Run
    step_id: str
    fencing_token: int | None
    calls: dict[str, int] = field(default_factory=dict)


_scope: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("ledger_step_scope",
                                                                       default=None)


@contextmanager
def step_scope(run: Run | str, step_id: str, *, fencing_token: int | None = None):
    """Decorated actions called inside the block belong to `run`/`step_id` and take their
    idempotency key from them. A contextvar: each asyncio task sees its own scope."""
    run_obj = runs.as_run(run) if not isinstance(run, Run) else run
    token = _scope.set(_Scope(run_obj, step_id, fencing_token))
    try:
        yield
    finally:
        _scope.reset(token)


def _key_for(operation: str, key: Callable | None, args, kwargs, *, advance: bool = True
             ) -> tuple[str | None, str | None, _Scope | None]:
    """(idempotency key, call, scope) of one call. In a step scope the key is left to
    `record_intent`, which derives it from the run and step (`receipts.idempotency_key`):
    the first call of an operation in the scope has no `call`, the n-th has call "n".
    `advance=False` (a receipt's look-up) counts nothing: it names the last call made in
    the scope, or the first when none was."""
    scope = _scope.get()
    if scope is not None:
        n = scope.calls.get(operation, 0)
        if advance:
            n = scope.calls[operation] = n + 1
        n = max(n, 1)
        return None, (str(n) if n > 1 else None), scope
    if key is None:
        raise InvalidInput(
            f"expected a key for action {operation}: call it inside receipts.step_scope(run, "
            "step_id) or give @receipts.action a key= function, found neither (a generated "
            "key would send again after a crash)"
        )
    value = key(*args, **kwargs)
    if not isinstance(value, str | int) or isinstance(value, bool) or value == "":
        raise InvalidInput(f"expected key= of {operation} to return a non-empty string, "
                           f"found {value!r}")
    return str(value), None, None


# --- the decorator ---------------------------------------------------------------------------


def action(
    operation: str,
    *,
    target: str | Callable[..., str],
    key: Callable[..., str] | None = None,
    rejections: tuple[type[BaseException], ...] = (),
    external_id: Callable[[Any], Any] | None = None,
    tenant: str | Callable[..., str] = "default",
    retry_policy: str = RetryPolicy.IF_ABSENT_PROVEN,
    redact: Iterable[str] = (),
    fingerprint_fields: Iterable[str] | None = None,
    in_flight_for=None,
    keep: Iterable[str] | None = None,
    relies_on: Callable[..., Iterable[Any]] | Iterable[Any] = (),
    submit: bool = True,
    account: str | Callable[..., str] = "",
    wait: float | None = None,
):
    """Make a function's external side effect happen at most once per idempotency key.

    Per call: record the intent (bound arguments, defaults applied; InvalidInput if they
    are not JSON); then by the operation's state:
    planned / safe_to_retry -> mark submitted (attempt + 1 on a retry), call, record the
    outcome: return value -> succeeded with `result`; an exception in `rejections` ->
    rejected; any other exception -> outcome_unknown; both re-raised.
    succeeded -> the stored result, without calling (UnstorableResult if it was not stored);
    submitted / outcome_unknown / reconciling / manual_review -> OutcomeUnknown, not called;
    rejected -> Rejected; abandoned -> Rejected too (a person decided it must not happen).
    A return value that is not JSON (or too large) is not stored: the operation is still
    succeeded, `result_unstorable` says why, and UnstorableResult carries the value.
    The ledger never retries: a safe_to_retry operation is sent again when the agent calls
    again (see `retries_due`).

    `keep` (dotted paths into the bound arguments, e.g. ["article.slug", "article.title"]):
    only those are stored and fingerprinted (`record_intent(keep=)`); the rest of the
    arguments never reach the database.

    `account`: the provider account the call acts as (`record_intent(account=)`).
    `target`, `account` and `tenant`: a value, or a function of the call's arguments (like `key`),
    whose result is checked as the value would be. The wrapper's `.receipt(*args,
    **kwargs)` returns that call's Operation, or None if it was never recorded; it never
    records or sends anything.

    `relies_on`: the fact versions the call was planned on, a list or a function of the
    call's arguments returning one (`record_intent(relies_on=)`): a call planned on a
    superseded version raises StaleFact and is not sent.

    `submit` (default True): a new call's intent and its submission are one commit
    (`record_intent(submit=True)`), so a call costs two commits with its outcome; False
    records the intent, then marks it submitted, a commit each (the rules are the same).
    `wait` (seconds, default none): a call that finds its key in flight (InFlight: another
    caller is sending it) looks again every `.retry_after` s for up to `wait` s and gets
    that caller's outcome (the stored result or its error), or sends it once
    reconciliation proved the earlier attempt absent; still in flight then: InFlight.
    """
    # Checked once, where the action is declared: a malformed declaration fails at import.
    check_operation_name(operation)
    if not callable(target) and check_string(target, "target", 2000):
        check_identifier(target, "target", 2000)
    if not callable(tenant):
        check_identifier(tenant, "tenant", 100)
    if not callable(account):
        receipts.check_account(account)
    check_choice(retry_policy, "retry_policy", RetryPolicy.values)
    if key is not None and not callable(key):
        raise InvalidInput(f"expected key= to be a function or None, found {type(key).__name__}")
    if external_id is not None and not callable(external_id):
        raise InvalidInput(f"expected external_id= to be a function or None, found "
                           f"{type(external_id).__name__}")
    if not isinstance(rejections, tuple) or not all(
            isinstance(r, type) and issubclass(r, BaseException) for r in rejections):
        raise InvalidInput(f"expected rejections= to be a tuple of exception classes, found "
                           f"{rejections!r}")
    if wait is not None and (isinstance(wait, bool) or not isinstance(wait, int | float)
                             or not 0 <= wait < math.inf):
        raise InvalidInput(f"expected wait to be seconds or None, found {wait!r}")
    redact_paths = tuple(check_paths(redact, "redact"))
    kept = None if keep is None else tuple(check_paths(keep, "keep"))
    fields = (None if fingerprint_fields is None
              else tuple(check_paths(fingerprint_fields, "fingerprint_fields")))

    def decorate(fn):
        signature = inspect.signature(fn)

        def prepare(args, kwargs) -> Operation:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            intent = dict(bound.arguments)
            for name, param in signature.parameters.items():
                if param.kind is inspect.Parameter.VAR_KEYWORD:
                    intent.update(intent.pop(name))
            check_json(intent, what="intent")
            idem, call, scope = _key_for(operation, key, args, kwargs)
            relied = relies_on(*args, **kwargs) if callable(relies_on) else relies_on
            token = scope.fencing_token if scope else None
            # The intent and its submission in one commit (`submit=True`); with
            # submit=False, the submission is start's, a commit of its own.
            submission = ({"submit": True, "fencing_token": token,
                           "in_flight_for": in_flight_for} if submit else {})
            op = receipts.record_intent(
                operation, _per_call(target, args, kwargs),
                intent, tenant=_per_call(tenant, args, kwargs),
                run=scope.run if scope else None, step=scope.step_id if scope else None,
                idempotency_key=idem, call=call, fingerprint_fields=fields,
                redact=redact_paths, retry_policy=retry_policy, keep=kept, relies_on=relied,
                account=_per_call(account, args, kwargs), **submission,
            )
            op._ledger_fencing_token = token
            return op

        def start(op: Operation) -> tuple[bool, Any]:
            """(True, None) when the caller should send now, else (False, stored result)."""
            if op.submitted_now:
                return True, None
            if op.state in states.SENDABLE:
                try:
                    _submitted(op, op._ledger_fencing_token, in_flight_for)
                except StaleVersion:
                    # Another caller of the same key moved it first: decide on its state.
                    op.refresh_from_db()
                    return False, _settled(op)
                return True, None
            return False, _settled(op)

        def start_waiting(op: Operation) -> tuple[bool, Any]:
            """`start`, looking again while the key is in flight, for up to `wait` s."""
            deadline = time.monotonic() + (wait or 0)
            while True:
                try:
                    return start(op)
                except InFlight as exc:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise
                    time.sleep(min(exc.retry_after, remaining))
                    op.refresh_from_db()

        async def astart_waiting(op: Operation) -> tuple[bool, Any]:
            deadline = time.monotonic() + (wait or 0)
            while True:
                try:
                    return await astart(op)
                except InFlight as exc:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise
                    await asyncio.sleep(min(exc.retry_after, remaining))
                    await sync_to_async(op.refresh_from_db, thread_sensitive=True)()

        def finish(op: Operation, value: Any) -> Any:
            ext = _external_id(external_id, value)
            stored, why = _storable(value)
            _succeeded(op, ext, stored, why, op._ledger_fencing_token)
            if why:
                raise UnstorableResult(
                    f"expected the return value of {operation} to be storable JSON, found "
                    f"{why}; operation {op.operation_id} is recorded as succeeded without "
                    "its result; the value is on this error's .value",
                    operation=op, value=value,
                )
            return value

        def failed(op: Operation, exc: BaseException) -> None:
            code, detail = receipts.failure_record(exc)
            token = op._ledger_fencing_token
            if rejections and isinstance(exc, rejections):
                receipts.mark_rejected(op, error_code=code, detail=detail, fencing_token=token)
            else:
                receipts.mark_outcome_unknown(op, error_code=code, detail=detail,
                                              fencing_token=token)

        def receipt(*args, **kwargs) -> Operation | None:
            """This call's receipt (same arguments: same key), or None; never a write."""
            signature.bind(*args, **kwargs)
            idem, call, scope = _key_for(operation, key, args, kwargs, advance=False)
            if scope is not None:
                idem = receipts.idempotency_key(scope.run.run_id, scope.step_id, call)
            return Operation.objects.filter(
                tenant=_per_call(tenant, args, kwargs), operation=operation,
                idempotency_key=idem).first()

        if inspect.iscoroutinefunction(fn):
            aprepare = sync_to_async(prepare, thread_sensitive=True)
            astart = sync_to_async(start, thread_sensitive=True)
            afinish = sync_to_async(finish, thread_sensitive=True)
            afailed = sync_to_async(failed, thread_sensitive=True)

            @functools.wraps(fn)
            async def async_wrapper(*args, **kwargs):
                with tracing.action_span(operation) as span:
                    try:
                        op = await aprepare(args, kwargs)
                    except LedgerError as exc:  # the submission refused, the intent recorded
                        span.record(getattr(exc, "recorded_operation", None))
                        raise
                    try:
                        send, stored = await astart_waiting(op)
                        if not send:
                            return stored
                        try:
                            value = await fn(*args, **kwargs)
                        except BaseException as exc:
                            await afailed(op, exc)
                            raise
                        return await afinish(op, value)
                    finally:
                        span.record(op)

            async_wrapper.operation_name = operation
            async_wrapper.receipt = sync_to_async(receipt, thread_sensitive=True)
            return async_wrapper

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with tracing.action_span(operation) as span:
                try:
                    op = prepare(args, kwargs)
                except LedgerError as exc:  # the submission refused, the intent recorded
                    span.record(getattr(exc, "recorded_operation", None))
                    raise
                try:
                    send, stored = start_waiting(op)
                    if not send:
                        return stored
                    try:
                        value = fn(*args, **kwargs)
                    except BaseException as exc:
                        failed(op, exc)
                        raise
                    return finish(op, value)
                finally:
                    span.record(op)

        wrapper.operation_name = operation
        wrapper.receipt = receipt
        return wrapper

    return decorate


def _per_call(value: Any, args, kwargs) -> Any:
    """A declared value, or what a function of the call's arguments gives for this call
    (checked by `record_intent` as any value is)."""
    return value(*args, **kwargs) if callable(value) else value


def _settled(op: Operation) -> Any:
    """What a call of a key that is not to be sent gets: the stored result or an error."""
    if op.state == State.SUCCEEDED:
        if op.result_unstorable:
            raise UnstorableResult(
                f"expected a stored result of operation {op.operation_id} ({op.operation}), "
                f"found none: {op.result_unstorable}; it succeeded (external id "
                f"{op.external_id or 'none'}) and is not sent again",
                operation=op,
            )
        return op.result
    if op.state in (State.REJECTED, State.ABANDONED):
        raise Rejected(
            f"expected operation {op.operation_id} ({op.operation}, key "
            f"{op.idempotency_key}) to be sendable, found it {op.state}"
            + (f" with code {op.error_code}" if op.error_code else "")
            + "; it is not sent again",
            operation=op,
        )
    if op.state == State.SUBMITTED:
        raise InFlight.of(op)
    raise OutcomeUnknown(
        f"expected operation {op.operation_id} ({op.operation}, key {op.idempotency_key}) "
        f"planned, safe_to_retry or succeeded, found {op.state}: an earlier attempt was sent "
        "and its effect is not proven; it is not sent again until reconciliation or a "
        "person decides",
        operation=op,
    )


def _submitted(op: Operation, fencing_token, in_flight_for) -> Operation:
    return receipts.mark_submitted(op, fencing_token=fencing_token, in_flight_for=in_flight_for)


def _external_id(extract: Callable | None, value: Any) -> str | None:
    if extract is None:
        return None
    try:
        found = extract(value)
    except Exception:  # noqa: BLE001 - the effect happened; the id is a nicety
        return None
    if found is None:
        return None
    try:
        text = found if isinstance(found, str) else str(found)
    except Exception:  # noqa: BLE001 - as above
        return None
    # The external system's own id, recorded as it came (only made storable): the effect
    # happened, and refusing its id would lose the success.
    text = storable(text.strip(), 500)
    return text or None


def _storable(value: Any) -> tuple[Any, str]:
    """(redacted value, "") or (None, why it cannot be stored)."""
    return receipts.storable_result(value)


def _succeeded(op, external_id, result, unstorable, fencing_token) -> Operation:
    """receipts.mark_succeeded, also setting the result columns."""
    changes: dict[str, Any] = {"result": result, "result_unstorable": unstorable}
    if external_id is not None:
        changes["external_id"] = scrub_text(external_id)
    return transitions.by_agent(
        op, State.SUCCEEDED, fencing_token=fencing_token,
        reason="the external system confirmed it", changes=changes,
    )


# --- retries ---------------------------------------------------------------------------------


def retries_due(*, tenant: str = "default", operation: str | None = None):
    """The operations waiting in safe_to_retry, oldest first (by when they got there).

    The ledger never sends them itself: call the action again (same arguments, same key) and
    it is sent as attempt + 1.
    """
    check_identifier(tenant, "tenant", 100)
    if operation is not None:
        check_operation_name(operation)
    qs = Operation.objects.filter(tenant=tenant, state=State.SAFE_TO_RETRY)
    if operation is not None:
        qs = qs.filter(operation=operation)
    return qs.order_by("state_changed_at", "id")


# --- async twins -----------------------------------------------------------------------------

# One whole receipts call per thread hop: its durable transaction opens and commits in the
# worker thread that owns the connection, never across an await.
arecord_intent = sync_to_async(receipts.record_intent, thread_sensitive=True)
amark_submitted = sync_to_async(receipts.mark_submitted, thread_sensitive=True)
amark_succeeded = sync_to_async(receipts.mark_succeeded, thread_sensitive=True)
amark_rejected = sync_to_async(receipts.mark_rejected, thread_sensitive=True)
amark_outcome_unknown = sync_to_async(receipts.mark_outcome_unknown, thread_sensitive=True)


class AsyncAttempt:
    """Handed out by `asubmit`: say how the call went."""

    def __init__(self, op: Operation, fencing_token: int | None):
        self.op = op
        self._fencing_token = fencing_token
        self.finished = False

    async def succeeded(self, *, external_id: str | None = None, evidence: Any = None):
        self.op = await amark_succeeded(self.op, external_id=external_id, evidence=evidence,
                                        fencing_token=self._fencing_token)
        self.finished = True
        return self.op


@asynccontextmanager
async def asubmit(op: Operation, rejections: tuple[type[BaseException], ...] = (), *,
                  fencing_token: int | None = None, in_flight_for=None):
    """`receipts.submit` for coroutines: marks `op` submitted, runs the block, records how
    it ended (normal exit: succeeded; `rejections`: rejected; anything else:
    outcome_unknown; exceptions re-raised)."""
    await sync_to_async(_submitted, thread_sensitive=True)(op, fencing_token, in_flight_for)
    attempt = AsyncAttempt(op, fencing_token)
    try:
        yield attempt
    except BaseException as exc:
        if not attempt.finished:
            code, detail = receipts.failure_record(exc)
            if rejections and isinstance(exc, rejections):
                await amark_rejected(op, error_code=code, detail=detail,
                                     fencing_token=fencing_token)
            else:
                await amark_outcome_unknown(op, error_code=code, detail=detail,
                                            fencing_token=fencing_token)
        raise
    if not attempt.finished:
        await attempt.succeeded()
