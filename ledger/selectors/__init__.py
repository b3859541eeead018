"""Every read the desk (and, through the same helpers, any other front end) needs, by noun.

A principal is a desk user or an agent key (the HTTP API and the MCP tools ask here too):
`ledger.access.tenants_for` answers for both, so each behaves the same.

- `base`: `visible(principal, Model)`, the one tenant filter; `fetch_one`, the one
  fetch-and-check; `lookup_id`, the one check of an id before it is looked up;
  `capped_count`.
- `pagination`: keyset pages on (timestamp, id), or on a unique key (`key_page`), the one
  way every list pages.
- `operations`, `facts`, `runs`, `audit`, `retention`: the reads of each noun, and the
  `access_*` helpers that fetch one object and check the principal may see it
  (`access_operation`, `access_conflict`, `access_run`, `access_obligation`,
  `access_policy`), raising errors.NotFound or errors.PermissionDenied themselves.
  `access_operation` is one prepared statement (`ledger.prepared`), or none when the
  agent key's authentication read the operation with it (`remember_read`).
- `calls`: an agent's earlier calls, which the MCP gateway decides its default idempotency
  key with (`earlier_call`, `call_between`), and whether an approval request is pending.
- `charts`: the overview's grouped counts (the queue's ages, unknown outcomes per
  operation); imported as `ledger.selectors.charts`.

Writers (`receipts`, `facts`, `runs`, ...) import reads, never the other way round; the one
exception is `ledger.retention`, whose rule the preview counts with (its SQL is the
purge's). The names below are re-exported, so `selectors.review_queue` keeps working.
"""

from ledger.selectors.approvals import (
    AWAITING_COUNT_CAP,
    ApprovalPanel,
    ApprovalStatus,
    Proposals,
    approval_panel,
    approval_policies,
    approval_status,
    awaiting_count,
    awaiting_page,
    pending_proposal,
    proposals_of,
    visible_awaiting,
)
from ledger.selectors.audit import (
    AuditFilters,
    HeadStatus,
    VisibleAuditStatus,
    audit_events,
    audit_page,
    audit_status,
    audit_status_for,
    iter_audit_events,
)
from ledger.selectors.base import capped_count, fetch_one, lookup_id, visible
from ledger.selectors.calls import EarlierCall, approval_pending, call_between, earlier_call
from ledger.selectors.facts import (
    ConflictDetail,
    FactDetail,
    access_conflict,
    access_fact,
    conflict_detail,
    conflict_page,
    conflicts_for,
    fact_detail,
    fact_version,
    visible_conflicts,
)
from ledger.selectors.operations import (
    CONFLICT_COUNT_CAP,
    CONFLICTING,
    QUEUE_STATES,
    SEARCH_MIN_FRAGMENT,
    OperationDetail,
    OperationReceipt,
    QueueFilters,
    QueuePage,
    QueuePulse,
    access_operation,
    can_acknowledge,
    can_claim,
    duplicates_of,
    operation_detail,
    operation_receipt,
    operations_page,
    queue_next,
    queue_pulse,
    queue_selection,
    queue_signature,
    remember_read,
    resolutions_for,
    review_queue,
    visible_operations,
    with_claims,
    with_review_flags,
)
from ledger.selectors.pagination import MAX_PAGE_SIZE, Page, make_cursor, parse_cursor
from ledger.selectors.retention import access_policy, access_state_policy, retention_overview
from ledger.selectors.runs import (
    EXECUTION_COUNT_CAP,
    ExecutionCounts,
    RunDetail,
    RunRecords,
    access_obligation,
    access_run,
    execution_counts,
    overdue_page,
    run_detail,
    run_records,
    visible_overdue,
)
from ledger.selectors.saved_views import access_saved_view, saved_views_for

__all__ = [
    "CONFLICTING", "CONFLICT_COUNT_CAP", "EXECUTION_COUNT_CAP", "MAX_PAGE_SIZE",
    "QUEUE_STATES", "AuditFilters", "ConflictDetail", "ExecutionCounts", "HeadStatus",
    "FactDetail", "access_fact", "fact_detail",
    "OperationDetail", "Page", "QueueFilters", "QueuePage", "RunDetail", "RunRecords",
    "VisibleAuditStatus", "access_conflict", "access_operation", "access_policy",
    "access_state_policy",
    "access_run", "audit_events", "audit_page", "audit_status", "audit_status_for",
    "can_acknowledge", "capped_count", "conflict_detail", "conflict_page", "conflicts_for",
    "duplicates_of",
    "execution_counts", "fetch_one", "iter_audit_events", "make_cursor", "operation_detail",
    "overdue_page", "parse_cursor", "resolutions_for", "retention_overview", "review_queue",
    "run_detail", "run_records", "visible", "visible_conflicts", "visible_operations",
    "visible_overdue", "with_review_flags", "can_claim", "with_claims",
    "AWAITING_COUNT_CAP", "queue_selection", "ApprovalPanel", "approval_panel", "approval_policies",
    "awaiting_count", "awaiting_page", "visible_awaiting",
    "QueuePulse", "queue_pulse", "queue_signature",
    "SEARCH_MIN_FRAGMENT", "queue_next", "access_saved_view", "saved_views_for",
    "ApprovalStatus", "approval_status", "OperationReceipt", "operation_receipt",
    "operations_page", "remember_read", "access_obligation", "lookup_id",
    "Proposals", "pending_proposal", "proposals_of", "fact_version",
    "EarlierCall", "earlier_call", "call_between", "approval_pending",
]
