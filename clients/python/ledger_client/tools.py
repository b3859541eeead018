"""What a model reads when a tool's action did not simply return: one sentence per case,
naming the operation and saying what to do next, so an agent framework can hand it to the
model as the tool's answer (`failure_error_function=`, `handle_tool_errors=`, or a
`try`/`except` in the tool).

    @function_tool(failure_error_function=lambda context, error: tool_message(error))
    @ledger.action("articles.create", target=..., key=...)
    def publish_article(title: str, body: str) -> dict: ...
"""

from __future__ import annotations

from typing import Any

from ledger_client import errors

UNKNOWN_STATES = ("submitted", "outcome_unknown", "reconciling")
MAX_DETAIL = 300


def tool_message(error: Exception) -> str:
    """The message for the model about `error`, raised by a `ledger.action` call (or by the
    framework around it). Never raises.

    - in flight (`InFlight`): another call is sending the same key; call again shortly
    - the outcome is not proven (`OutcomeUnknown`, `OutcomeNotRecorded`, or the call's own
      exception recorded as outcome_unknown): "... Do not retry; the ledger is reconciling
      operation X." (in manual_review: a person decides operation X)
    - rejected or abandoned, denied: not carried out; do not retry with the same arguments
    - approval required: nothing sent; call again once a person approved it
    - the ledger unreachable before the call: nothing sent; try again later
    - anything else: the tool failed, with the error's class and message.
    """
    receipt = (error.operation if isinstance(error, errors.LedgerError)
               else getattr(error, "ledger_operation", None))
    state = _field(receipt, "state")
    name = _field(receipt, "operation") or "the action"
    op = _field(receipt, "operation_id")
    which = f"{name} (operation {op})" if op else name
    cause = f"its state is {state}" if isinstance(error, errors.OutcomeUnknown) else _brief(error)

    if isinstance(error, errors.ApprovalDenied):
        reason = f": {_clip(error.reason)}" if error.reason else ""
        return (f"Denied: a person denied {which}{reason}. It was not sent; do not retry "
                "it.")
    if isinstance(error, errors.ApprovalRequired):
        return (f"Waiting for approval: {which} needs a person's approval on the ledger's "
                "desk; nothing was sent. Call it again with the same arguments once it is "
                "approved.")
    if isinstance(error, errors.StaleFencingToken):
        return ("Stopped: another worker took over this run; nothing was sent. Do not "
                "continue this run.")
    if isinstance(error, errors.InFlight):
        return (f"In flight: {which} is being sent right now by another call with the same "
                f"key; this call sent nothing. Call again in {error.retry_after:g} s with the "
                "same arguments to get its outcome.")
    if state == "manual_review":
        return (f"Outcome unknown: {which} was sent and whether it took effect is not "
                f"proven; a person is reviewing it. Do not retry; a person decides "
                f"operation {op}.")
    if op and state in UNKNOWN_STATES and (
            isinstance(error, errors.OutcomeUnknown | errors.OutcomeNotRecorded)
            or not isinstance(error, errors.LedgerError)):
        return (f"Outcome unknown: {which} was sent and whether it took effect is not "
                f"proven ({cause}). Do not retry; the ledger is reconciling operation "
                f"{op}.")
    if state in ("rejected", "abandoned"):
        return (f"Rejected: {which} was {state} ({cause}). It was not carried out; do not "
                "retry it with the same arguments.")
    if isinstance(error, errors.UnstorableResult):
        return (f"Done: {which} succeeded, but its result could not be stored. Do not call "
                "it again.")
    if isinstance(error, errors.LedgerUnavailable):
        return (f"Not sent: the ledger could not be reached ({cause}); nothing was sent. "
                "You may try again later.")
    if isinstance(error, errors.LedgerError):
        return f"Not sent: the ledger refused the call ({cause})."
    return f"The tool failed ({cause})."


def _field(receipt: Any, name: str) -> Any:
    data = getattr(receipt, "data", None)
    return data.get(name) if isinstance(data, dict) else None


def _brief(error: BaseException) -> str:
    try:
        text = str(error)
    except Exception:  # noqa: BLE001 - a strange exception still gets a message
        text = ""
    name = type(error).__name__
    return f"{name}: {_clip(text)}" if text else name


def _clip(text: Any) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= MAX_DETAIL else text[:MAX_DETAIL - 1] + "…"
