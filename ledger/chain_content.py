"""What an operation event's chain link covers of its operation, as SQL PostgreSQL runs.

An event's `chain_format` and `content` are PostgreSQL's alone: the event's BEFORE INSERT
trigger `event_chain_columns` (ledger.models.operations) sets `chain_format` to
`CURRENT_FORMAT` and computes `content` from the operation row the event's own statement
wrote, whatever the writer sent, and refuses an event written already linked
(`chain_seq`, `chain_hash`: the sealer's, `ledger_seal_events`). Verification
(`ledger.chain`) computes the same content again from the stored row.

Here, not in `ledger.chain`, because the models' trigger is built from it and
`ledger.chain` imports the models.
"""

from __future__ import annotations

# The format every operation event is written in now (ledger.chain's docstring lists them).
CURRENT_FORMAT = 3


def digest_sql(value: str) -> str:
    """The SQL of the sha256 (hex) of `value`'s text (jsonb's own text form); NULL stays NULL."""
    return f"encode(sha256(convert_to(({value})::text, 'UTF8')), 'hex')"


def content_sql(row: str, *, intent: str | None = None) -> str:
    """The SQL of what a format 3 link covers of the operation `row` (a table alias with the
    operation's columns): its target, key, retry policy, fingerprint and the digests of its
    intent and result, as a jsonb object (`intent`: another expression for the intent's
    digest, for a redacted one)."""
    return (f"jsonb_build_object('target', {row}.target, 'intent', "
            f"{intent or digest_sql(f'{row}.intent')}, 'fingerprint', "
            f"{row}.intent_fingerprint, 'key', {row}.idempotency_key, 'retry_policy', "
            f"{row}.retry_policy, 'result', {digest_sql(f'{row}.result')})")


# The event's chain columns, set by PostgreSQL on every INSERT (see the module docstring).
# Runs as the writer: it reads the operation row the same statement wrote (a volatile
# trigger function sees the rows its statement changed before this one).
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
    SELECT {content_sql("o")} INTO NEW.content
      FROM ledger_operation o WHERE o.id = NEW.operation_id;
    RETURN NEW;
"""
