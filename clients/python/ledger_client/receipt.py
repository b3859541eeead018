"""What the ledger answers about an operation, as an object."""

from __future__ import annotations

from typing import Any

OPEN_STATES = ("submitted", "outcome_unknown", "reconciling", "manual_review")


class Receipt:
    """An operation as the ledger answered it: `operation_id`, `tenant`, `operation`,
    `target`, `state`, `version`, `attempt`, `idempotency_key`, `intent_fingerprint`,
    `external_id`, `result`, `error_code`, ... (every field of the API's operation, as
    attributes); `.data` is the whole answer; `.replayed` whether it was served from the
    stored receipt."""

    __slots__ = ("data",)

    def __init__(self, data: dict[str, Any]):
        self.data = data

    @property
    def replayed(self) -> bool:
        """True when the ledger answered from this stored receipt instead of recording or
        sending anything for the request (its `Idempotent-Replayed: true`): a repeat of an
        earlier call, whose recorded state and result these are."""
        return bool(self.data.get("replayed", False))

    def __getattr__(self, name: str) -> Any:
        try:
            return self.data[name]
        except KeyError:
            raise AttributeError(f"expected a field {name!r} of the receipt, found none "
                                 f"(fields: {sorted(self.data)})") from None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Receipt) and other.data == self.data

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"<Receipt {self.data.get('operation_id')} {self.data.get('operation')} "
                f"{self.data.get('state')} v{self.data.get('version')}>")
