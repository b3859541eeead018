"""The ledger's triggers: pgtrigger's, minus the switch any role could flip.

pgtrigger wraps every trigger function in a check of the session setting
`pgtrigger.ignore`, which any role may set with `set_config`: the least-privileged
application role could switch the ledger's rules off. Every trigger of the ledger is
therefore declared with `Trigger` or `Protect` from here, whose installed function is the
declared body and nothing else (`UnbypassableTriggerSql`).

The one sanctioned exception is retention: the purge and the redaction run inside the
SECURITY DEFINER functions `ledger_retention_purge` and `ledger_retention_redact`
(migration 0014), owned by the role that owns the tables; so does the sealer, which links
committed operation events into their chain (`ledger_seal_events`, see `SEALING`). The few
triggers that let them through ask `ledger_sanctioned(TG_RELID)`: TRUE only while the
current user is the table's owner AND the transaction-local `ledger.sanctioned` is
'retention' (which those functions set for their own duration). The application role may
set the setting, but it is not the owner, and it can become the owner only by calling
those functions, which write their own audit rows (PurgeRun counts, ChainAnchor,
Redaction) or, for the sealer, only set unsealed events' links.
"""

import pgtrigger
from pgtrigger import compiler

# What the few triggers that admit the purge call: see the module docstring.
SANCTIONED = "ledger_sanctioned(TG_RELID)"
# What the operation events' triggers admit besides: the sealer's function
# `ledger_seal_events` (migration 0025), which links committed events into their tenant's
# chain, setting `chain_seq` and `chain_hash` once (ledger.chain.seal). The same owner check
# as `ledger_sanctioned`, for the setting's value 'seal'.
SEALING = "ledger_sealing(TG_RELID)"
# The hint of PostgreSQL's refusal of a write that does not carry the current fencing token
# of its lease: ledger.transitions and ledger.leases raise StaleFencingToken for it, with
# the current token from the detail ('' when there is no lease).
FENCE_HINT = "stale_fencing_token"


class UnbypassableTriggerSql(compiler.UpsertTriggerSql):
    """pgtrigger's installation SQL without the `pgtrigger.ignore` hook.

    The function's search_path is pinned (temporary tables last), so that a session cannot
    shadow the tables a check reads (`ledger_operationevent`, say) with temporary ones.

    Referenced by migrations: never edit the template; add a new class instead.
    """

    def get_template(self) -> str:
        return """
            CREATE OR REPLACE FUNCTION {pgid}()
            RETURNS TRIGGER AS $$
                {declare}
                BEGIN
                    {func}
                END;
            $$ LANGUAGE plpgsql SET search_path = public, pg_temp;

            DROP TRIGGER IF EXISTS {pgid} ON {table};
            CREATE {constraint} TRIGGER {pgid}
                {when} {operation} ON {table}
                {timing}
                {referencing}
                FOR EACH {level} {condition}
                EXECUTE PROCEDURE {execute};

            COMMENT ON TRIGGER {pgid} ON {table} IS '{hash}';
        """


class Unbypassable:
    """Mixin for pgtrigger triggers: compile to `UnbypassableTriggerSql`."""

    def compile(self, model) -> compiler.Trigger:
        compiled = super().compile(model)
        kwargs = {k: v for k, v in compiled.sql.kwargs.items() if k != "ignore_func_name"}
        return compiler.Trigger(name=compiled.name, sql=UnbypassableTriggerSql(**kwargs))


class Trigger(Unbypassable, pgtrigger.Trigger):
    """A free-form trigger that no session setting switches off."""


class Protect(Unbypassable, pgtrigger.Protect):
    """pgtrigger's Protect (refuse the operations) that no session setting switches off."""
