import importlib

from django.db import migrations

# Issue 41, item 10: the purge and the redaction (SECURITY DEFINER, the reconciler's) checked
# only age and state, so a reconciler's login redacted and purged another tenant's operation
# under an unrelated policy's PurgeRun. Each now refuses an operation that its run's policy
# does not govern: the policy must match the operation (its tenant, or every tenant; its
# pattern, a glob, as LIKE) and no more specific policy may match it, in the order of
# `ledger.retention.specificity` (a policy naming the tenant first, then fewer wildcards,
# the longer literal prefix, the longer pattern, then the pattern and tenant in code-point
# order). The state purge (`ledger_retention_purge_state`, 0038) already holds each row to
# its policy's tenant (`_GOVERNS` there) and its kind.
_PREVIOUS = importlib.import_module("ledger.migrations.0029_operation_references_restrict")

_AGE_CHECK = ("    SELECT o.operation_id, o.state, o.completed_at INTO bad FROM ledger_operation o\n")
_GOVERNED = r"""    SELECT o.operation_id, o.operation, o.tenant, p.pattern AS policy_pattern,
           p.tenant AS policy_tenant, g.id AS governing_id, g.pattern AS governing_pattern,
           g.tenant AS governing_tenant INTO bad
      FROM ledger_operation o
      JOIN ledger_retentionpolicy p ON p.id = run.policy_id
      LEFT JOIN LATERAL (
          SELECT q.id, q.pattern, q.tenant FROM ledger_retentionpolicy q
           WHERE (q.tenant = '' OR q.tenant = o.tenant)
             AND o.operation LIKE replace(replace(replace(replace(replace(
                     q.pattern, '\', '\\'), '%', '\%'), '_', '\_'), '*', '%'), '?', '_')
                 ESCAPE '\'
           ORDER BY q.tenant = '',
                    length(q.pattern) - length(replace(replace(q.pattern, '*', ''), '?', '')),
                    length(substring(q.pattern FROM '^[^*?]*')) DESC,
                    length(q.pattern) DESC, q.pattern COLLATE "C", q.tenant COLLATE "C"
           LIMIT 1) g ON true
     WHERE o.id = ANY(operation_ids) AND g.id IS DISTINCT FROM run.policy_id
     LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('operation %s (%s, tenant %s): expected an operation governed by '
                             'run %s''s policy (%s, %s) to %s, found it governed by %s',
                             bad.operation_id, bad.operation, bad.tenant, run.id,
                             bad.policy_pattern,
                             coalesce(nullif(bad.policy_tenant, ''), 'every tenant'), doing,
                             CASE WHEN bad.governing_id IS NULL THEN 'no policy'
                                  ELSE format('the policy %s (%s)', bad.governing_pattern,
                                              coalesce(nullif(bad.governing_tenant, ''),
                                                       'every tenant')) END);
    END IF;
"""
assert _PREVIOUS.PURGE_REFERRING_FIRST.count(_AGE_CHECK) == 2  # the purge's and the redaction's
GOVERNED_ONLY = _PREVIOUS.PURGE_REFERRING_FIRST.replace(_AGE_CHECK, _GOVERNED + _AGE_CHECK)


class Migration(migrations.Migration):

    dependencies = [
        ("ledger", "0043_chain_columns_postgres_only"),
    ]

    operations = [
        migrations.RunSQL(GOVERNED_ONLY, _PREVIOUS.PURGE_REFERRING_FIRST),
    ]
