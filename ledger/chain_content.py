"""What an operation event's chain link covers of its operation, as SQL PostgreSQL runs.

An event's `chain_format` and `content` are PostgreSQL's alone: the event's BEFORE INSERT
trigger `event_chain_columns` (ledger.models.operations) sets `chain_format` to
`CURRENT_FORMAT` and computes `content` from the operation row the event's own statement
wrote, whatever the writer sent, and refuses an event written already linked
(`chain_seq`, `chain_hash`: the sealer's, `ledger_seal_events`). Verification
(`ledger.chain`) computes the same content again from the stored row, in the format of the
operation's last event.

Here, not in `ledger.chain`, because the models' trigger is built from it and
`ledger.chain` imports the models.
"""

from __future__ import annotations

# The format every operation event is written in now (ledger.chain's docstring lists them).
CURRENT_FORMAT = 5

# Format 4's content beyond format 3's: (key, operation column, how it is held). "text":
# the value itself; "digest": the sha256 of its text (long or structured values);
# "time": the instant in UTC, whatever the session's time zone.
FORMAT_4_COLUMNS = (
    ("operation", "operation", "text"),
    ("tenant", "tenant", "text"),
    ("run", "run_id", "text"),
    ("step", "step_id", "text"),
    ("relies_on", "relies_on", "digest"),
    ("attempt", "attempt", "text"),
    ("created_at", "created_at", "time"),
    ("submitted_at", "submitted_at", "time"),
    ("in_flight_until", "in_flight_until", "time"),
    ("completed_at", "completed_at", "time"),
    ("error_code", "error_code", "text"),
    ("error_detail", "error_detail", "digest"),
    ("conflict", "conflict", "text"),
    ("trace_id", "trace_id", "text"),
    ("span_id", "span_id", "text"),
    ("authentication_recorded", "authentication_recorded", "text"),
    ("unknown_since", "unknown_since", "time"),
    ("next_attempt_at", "next_attempt_at", "time"),
    ("reconcile_attempts", "reconcile_attempts", "text"),
    ("reconcile_failures", "reconcile_failures", "text"),
    ("reread_due_at", "reread_due_at", "time"),
    ("result_unstorable", "result_unstorable", "text"),
)
# Format 5's content beyond format 4's: the provider account the call acts as.
FORMAT_5_COLUMNS = (("account", "account", "text"),)
# The keys whose value is a digest (a break prints them as such).
DIGESTS = frozenset({"intent", "result"} | {key for key, _, how in FORMAT_4_COLUMNS
                                            if how == "digest"})


def digest_sql(value: str) -> str:
    """The SQL of the sha256 (hex) of `value`'s text (jsonb's own text form); NULL stays NULL."""
    return f"encode(sha256(convert_to(({value})::text, 'UTF8')), 'hex')"


def time_sql(value: str) -> str:
    """The SQL of the instant `value` as text in UTC (microseconds); NULL stays NULL."""
    return f"to_char(({value}) AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')"


def content_sql(row: str, *, chain_format: int = CURRENT_FORMAT,
                held: dict[str, str] | None = None) -> str:
    """The SQL of what a link of `chain_format` (3 or later) covers of the operation `row`
    (a table alias with the operation's columns), as a jsonb object: format 3 its target,
    key, retry policy, fingerprint and the digests of its intent and result; format 4 also
    every column of `FORMAT_4_COLUMNS`; format 5 also those of `FORMAT_5_COLUMNS`.
    `held`: another SQL expression for some keys (for verification: what retention's
    redaction or the duplicate mark leave)."""
    held = held or {}
    pairs = [("target", f"{row}.target"), ("intent", digest_sql(f"{row}.intent")),
             ("fingerprint", f"{row}.intent_fingerprint"), ("key", f"{row}.idempotency_key"),
             ("retry_policy", f"{row}.retry_policy"), ("result", digest_sql(f"{row}.result"))]
    if chain_format >= 4:
        how_sql = {"text": lambda c: f"{row}.{c}", "digest": lambda c: digest_sql(f"{row}.{c}"),
                   "time": lambda c: time_sql(f"{row}.{c}")}
        pairs += [(key, how_sql[how](column)) for key, column, how in FORMAT_4_COLUMNS]
        if chain_format >= 5:
            pairs += [(key, how_sql[how](column)) for key, column, how in FORMAT_5_COLUMNS]
    # jsonb_build_object takes at most 100 arguments: two objects joined stay below that.
    parts = [pairs[i:i + 40] for i in range(0, len(pairs), 40)]
    return " || ".join(
        "jsonb_build_object(" + ", ".join(f"'{key}', {held.get(key, value)}"
                                          for key, value in part) + ")"
        for part in parts)


# The event's chain columns, set by PostgreSQL on every INSERT (see the module docstring).
# Runs as the writer: it reads the operation row the same statement wrote (a volatile
# trigger function sees the rows its statement changed before this one), under the writer's
# row-level security. The same read holds the event's tenant to its operation's: an
# operation of another tenant, or one this session may not see, refuses the event (this
# was a deferred constraint trigger of its own, event_tenant_check, a second look-up of the
# same row at every commit: migration 0055 folded it in here).
EVENT_CHAIN_COLUMNS_SQL = f"""
    IF NEW.chain_seq IS NOT NULL OR NEW.chain_hash IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',
            MESSAGE = format('event of operation %s at version %s: expected it written '
                             'unsealed (chain_seq and chain_hash NULL: only the sealer links '
                             'an event, through ledger_seal_events), found chain_seq %s',
                             NEW.operation_id, NEW.version,
                             COALESCE(NEW.chain_seq::text, 'NULL'));
    END IF;
    NEW.chain_format := {CURRENT_FORMAT};
    SELECT {content_sql("o")}, o.tenant INTO NEW.content, op_tenant
      FROM ledger_operation o WHERE o.id = NEW.operation_id;
    IF op_tenant IS DISTINCT FROM NEW.tenant THEN
        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',
            MESSAGE = format('event of operation id %s: expected its operation''s tenant, '
                             'found %s on the event and %s on an operation this session '
                             'may see', NEW.operation_id, NEW.tenant,
                             COALESCE(op_tenant, 'none'));
    END IF;
    RETURN NEW;
"""


# --- rows people rely on, beside the operations (the "records" chain) -------------------------
#
# Every INSERT, UPDATE and DELETE of these tables appends a `RecordLink` (ledger.models.chain),
# written by PostgreSQL alone: the AFTER ROW triggers `ledger_record_link` (migration 0049)
# call the SECURITY DEFINER function of that name, which stores the row's tenant, table, id,
# the move and, but for a delete, its content: per column, the sha256 of the column's value as
# jsonb text (`ledger_record_content`, in UTC whatever the session's time zone). No role may
# insert a link itself; the sealer links them into a chain per tenant (`ledger_seal_links`).
# Verification holds every stored row to its latest link and every link to a stored row.
# source (the name a link and a break give the table) -> table
RECORD_SOURCES = {
    "approval_policy": "ledger_approvalpolicy",
    "approval_policy_change": "ledger_approvalpolicychange",
    "approval_request": "ledger_approvalrequest",
    "approval": "ledger_approval",
    "resolution_proposal": "ledger_resolutionproposal",
    "operation_note": "ledger_operationnote",
    "tenant_access": "ledger_tenantaccess",
    "tenant_access_change": "ledger_tenantaccesschange",
    "fact": "ledger_fact",
    "fact_conflict": "ledger_factconflict",
    "fact_decision": "ledger_factdecision",
    "unknown_outcome_policy": "ledger_unknownoutcomepolicy",
    "unknown_outcome_policy_change": "ledger_unknownoutcomepolicychange",
}
# Columns a record's content leaves out: a fact decision's own link, set once by the sealer
# (its chain, "fact_decisions", covers the rest of the row too).
RECORD_UNCOVERED = ("chain_seq", "chain_hash")


def record_content_sql(row: str) -> str:
    """The SQL of a record's content (`row`: a table alias), as the link stored it."""
    return f"ledger_record_content({row})"


def written_unsealed_sql(what: str, *, unsealed_hash: str = "NULL") -> str:
    """A BEFORE INSERT trigger's body refusing a row written already linked: `chain_seq`
    and `chain_hash` are the sealer's alone. `unsealed_hash`: the hash column's unset value."""
    return f"""
    IF NEW.chain_seq IS NOT NULL OR NEW.chain_hash IS DISTINCT FROM {unsealed_hash} THEN
        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',
            MESSAGE = format('{what} of tenant %s: expected it written unsealed (chain_seq '
                             'and chain_hash unset: only the sealer links it, through '
                             'ledger_seal_links), found chain_seq %s',
                             NEW.tenant, COALESCE(NEW.chain_seq::text, 'NULL'));
    END IF;
    RETURN NEW;
"""


def sealed_once_sql(what: str) -> str:
    """A BEFORE UPDATE trigger's body: the one UPDATE a chained row admits (the statement
    trigger admits only the sealer's function) sets its chain_seq and chain_hash, from
    unset to set, and nothing else."""
    rest = "to_jsonb(NEW) - 'chain_seq' - 'chain_hash'"
    old = "to_jsonb(OLD) - 'chain_seq' - 'chain_hash'"
    return f"""
    IF OLD.chain_seq IS NOT NULL OR NEW.chain_seq IS NULL OR {rest} IS DISTINCT FROM {old} THEN
        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',
            MESSAGE = format('{what} %s: expected the sealer to set an unsealed row''s '
                             'chain_seq and chain_hash and nothing else, found chain_seq '
                             '%s -> %s and other columns %s', OLD.id,
                             COALESCE(OLD.chain_seq::text, 'unset'),
                             COALESCE(NEW.chain_seq::text, 'unset'),
                             CASE WHEN {rest} IS DISTINCT FROM {old}
                                  THEN 'changed' ELSE 'unchanged' END);
    END IF;
    RETURN NEW;
"""


# A record link is written by `ledger_record_link` alone: from inside another table's
# trigger (so at trigger depth 2), unsealed. A direct INSERT, the owner's too, is refused.
RECORD_LINK_INSERT_SQL = """
    IF pg_trigger_depth() < 2 THEN
        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',
            MESSAGE = format('record link of %s %s (tenant %s): expected it written by '
                             'PostgreSQL (the trigger ledger_record_link of the row''s table), '
                             'found a direct INSERT', NEW.source, NEW.row_id, NEW.tenant);
    END IF;
""" + written_unsealed_sql("record link")
