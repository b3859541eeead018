"""The ledger's tables. One module per area; everything is importable from here."""

from ledger.models.coordination import Lease, Run, Step, TenantAccess
from ledger.models.operations import Evidence, Operation, OperationEvent
from ledger.models.retention import (
    AuditVerification,
    ChainAnchor,
    ChainHead,
    PurgeRun,
    Redaction,
    RetentionChange,
    RetentionPolicy,
)

__all__ = [
    "AuditVerification",
    "ChainAnchor",
    "ChainHead",
    "Evidence",
    "Lease",
    "Operation",
    "OperationEvent",
    "PurgeRun",
    "Redaction",
    "RetentionChange",
    "RetentionPolicy",
    "Run",
    "Step",
    "TenantAccess",
]
