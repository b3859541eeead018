"""The ledger's tables. One module per area; everything is importable from here."""

from ledger.models.agent_keys import AgentKey, AgentKeyChange
from ledger.models.approvals import (
    Approval,
    ApprovalPolicy,
    ApprovalPolicyChange,
    ApprovalRequest,
    ResolutionProposal,
)
from ledger.models.chain import (
    AuditCheckpoint,
    AuditVerification,
    ChainAnchor,
    ChainHead,
    RecordLink,
)
from ledger.models.coordination import (
    Lease,
    Run,
    Step,
    StepState,
    TenantAccess,
    TenantAccessChange,
    WorkerLock,
)
from ledger.models.coverage import CoverageReading
from ledger.models.desk import Claim, OperationNote, SavedView
from ledger.models.execution import (
    ConflictState,
    Episode,
    Fact,
    FactConflict,
    FactDecision,
    FactStatus,
    Obligation,
    ObligationState,
)
from ledger.models.notifications import (
    DeliveryAttempt,
    NotificationBatch,
    NotificationChannel,
    NotificationChannelChange,
    NotificationSent,
)
from ledger.models.operations import Evidence, Operation, OperationEvent, OperationSearch
from ledger.models.outcome_policies import UnknownOutcomePolicy, UnknownOutcomePolicyChange
from ledger.models.retention import (
    PurgeRun,
    Redaction,
    RetentionChange,
    RetentionPolicy,
    StateKind,
    StateRetentionPolicy,
)

__all__ = [
    "UnknownOutcomePolicy",
    "UnknownOutcomePolicyChange",
    "AgentKey",
    "AgentKeyChange",
    "Approval",
    "ApprovalPolicy",
    "ApprovalPolicyChange",
    "ApprovalRequest",
    "AuditCheckpoint",
    "AuditVerification",
    "ChainAnchor",
    "ChainHead",
    "RecordLink",
    "Claim",
    "DeliveryAttempt",
    "ConflictState",
    "CoverageReading",
    "Episode",
    "Evidence",
    "Fact",
    "FactConflict",
    "FactDecision",
    "FactStatus",
    "Lease",
    "NotificationBatch",
    "NotificationChannel",
    "NotificationChannelChange",
    "NotificationSent",
    "Obligation",
    "ObligationState",
    "Operation",
    "OperationEvent",
    "OperationNote",
    "OperationSearch",
    "SavedView",
    "PurgeRun",
    "Redaction",
    "ResolutionProposal",
    "RetentionChange",
    "RetentionPolicy",
    "StateKind",
    "StateRetentionPolicy",
    "Run",
    "Step",
    "StepState",
    "TenantAccess",
    "TenantAccessChange",
    "WorkerLock",
]
