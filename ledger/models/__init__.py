"""The ledger's tables. One module per area; everything is importable from here."""

from ledger.models.coordination import Lease, Run, Step, TenantAccess
from ledger.models.operations import Evidence, Operation, OperationEvent

__all__ = [
    "Evidence",
    "Lease",
    "Operation",
    "OperationEvent",
    "Run",
    "Step",
    "TenantAccess",
]
