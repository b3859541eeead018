"""Retention of coverage readings (kind `coverage`): they were append-only and never purged,
so they grew without bound. A reading goes its policy's days after it was taken
(`created_at`), through `ledger_retention_purge_state` like the other kinds of execution
state: the function gains a branch for it (before this, any kind but facts and episodes was
read as obligations), checks each reading again by the database's clock, and never deletes
the latest reading of a tenant, operation name, target and account (what `/metrics`
reports). The table's trigger, a statement-level refusal that admitted anything inside the
sanctioned functions, is now a row-level one that admits only the purge's DELETE of a
reading that is not its key's latest; `coverage_latest_idx` answers "is there a later
one" (the target hashed, as `operation_control_idx` has it). The policy for every tenant is
90 days, as long as the default keeps intents unredacted: the unexplained effects hold the
provider's items.
"""

import importlib

import django.db.models.functions.text
import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations, models

import ledger.models.triggers

_PREVIOUS = importlib.import_module("ledger.migrations.0038_state_retention")

# Over alias `{x}`: a later reading of its tenant, operation, target and account exists
# (ledger.models.coverage.LATER_READING, as of this migration).
_LATER = (
    "EXISTS (SELECT 1 FROM ledger_coveragereading n WHERE n.tenant = {x}.tenant "
    "AND n.operation = {x}.operation AND md5(n.target) = md5({x}.target) "
    "AND n.target = {x}.target AND n.account = {x}.account "
    "AND (n.created_at, n.id) > ({x}.created_at, {x}.id))"
)

_COVERAGE_BRANCH = """    ELSIF policy.kind = 'coverage' THEN
        SELECT c.id, c.tenant, c.operation, c.target, c.created_at,
               """ + _PREVIOUS._GOVERNS.format(x="c") + """ AS governed,
               """ + _LATER.format(x="c") + """ AS superseded INTO bad
          FROM ledger_coveragereading c
         WHERE c.id = ANY(row_ids)
           AND NOT (c.created_at < cutoff AND """ + _PREVIOUS._GOVERNS.format(x="c") + """
                    AND """ + _LATER.format(x="c") + """)
         LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION USING ERRCODE = 'check_violation',
                MESSAGE = format('coverage %s (tenant %s, %s on %s): expected a reading taken '
                                 'more than %s days ago, governed by the policy for coverage '
                                 '(%s), and not the latest of its target, operation and '
                                 'account, to purge, found one taken at %s (%s, %s)', bad.id,
                                 bad.tenant, bad.operation, bad.target,
                                 policy.purge_after_days,
                                 coalesce(nullif(policy.tenant, ''), 'every tenant'),
                                 bad.created_at,
                                 CASE WHEN bad.governed THEN 'governed by it'
                                      ELSE 'governed by another policy' END,
                                 CASE WHEN bad.superseded THEN 'a later one exists'
                                      ELSE 'the latest' END);
        END IF;
        WITH d AS (DELETE FROM ledger_coveragereading WHERE id = ANY(row_ids) RETURNING id)
        SELECT array_agg(id ORDER BY id) INTO gone FROM d;
"""
_OBLIGATIONS_BRANCH = """    ELSE
        PERFORM 1 FROM ledger_run r WHERE r.id IN (
            SELECT ob.run_id FROM ledger_obligation ob"""
assert _PREVIOUS.PURGE_STATE.count(_OBLIGATIONS_BRANCH) == 1
_OBLIGATIONS_ONLY = """    ELSIF policy.kind = 'obligations' THEN
        PERFORM 1 FROM ledger_run r WHERE r.id IN (
            SELECT ob.run_id FROM ledger_obligation ob"""
_UNKNOWN_KIND = """    ELSE
        RAISE EXCEPTION USING ERRCODE = 'check_violation',
            MESSAGE = format('expected a state policy of a known kind (facts, episodes, '
                             'obligations, coverage), found kind %s', policy.kind);
    END IF;
    IF gone IS NULL THEN"""
_END = """    END IF;
    IF gone IS NULL THEN"""
assert _PREVIOUS.PURGE_STATE.count(_END) == 1
PURGE_STATE = (_PREVIOUS.PURGE_STATE
               .replace(_OBLIGATIONS_BRANCH, _COVERAGE_BRANCH + _OBLIGATIONS_ONLY)
               .replace(_END, _UNKNOWN_KIND))

DEFAULT_DAYS = 90


def create_default_policy(apps, schema_editor):
    from django.utils import timezone

    now = timezone.now()
    Policy = apps.get_model("ledger", "StateRetentionPolicy")
    RetentionChange = apps.get_model("ledger", "RetentionChange")
    policy, created = Policy.objects.get_or_create(
        kind="coverage", tenant="", defaults={"purge_after_days": DEFAULT_DAYS,
                                              "created_at": now, "updated_at": now})
    if created:
        RetentionChange.objects.create(
            state_policy_id=policy.pk, action="created",
            changed_by_name="migration 0058_coverage_retention", before=None,
            after={"kind": "coverage", "tenant": "", "purge_after_days": DEFAULT_DAYS},
            changed_at=now)


def delete_coverage_policies(apps, schema_editor):
    """Back to 0057, whose check constraint knows no coverage kind: the policies go, each
    with its change record (their runs keep their snapshots), and their deferred
    foreign-key checks fire before the constraint is altered."""
    from django.utils import timezone

    Policy = apps.get_model("ledger", "StateRetentionPolicy")
    RetentionChange = apps.get_model("ledger", "RetentionChange")
    for policy in Policy.objects.filter(kind="coverage"):
        RetentionChange.objects.create(
            state_policy_id=policy.pk, action="deleted",
            changed_by_name="migration 0058_coverage_retention, reversed",
            before={"kind": policy.kind, "tenant": policy.tenant,
                    "purge_after_days": policy.purge_after_days},
            after=None, changed_at=timezone.now())
        policy.delete()
    schema_editor.execute("SET CONSTRAINTS ALL IMMEDIATE")


class Migration(migrations.Migration):

    dependencies = [
        ('ledger', '0057_fact_links_within_tenant'),
    ]

    operations = [
        pgtrigger.migrations.RemoveTrigger(
            model_name='coveragereading',
            name='coverage_reading_append_only',
        ),
        migrations.RemoveConstraint(
            model_name='stateretentionpolicy',
            name='state_retention_kind_known',
        ),
        migrations.AlterField(
            model_name='stateretentionpolicy',
            name='kind',
            field=models.CharField(choices=[('facts', 'Superseded fact versions'), ('episodes', 'Episodes'), ('obligations', 'Settled obligations'), ('coverage', 'Coverage readings')], max_length=20),
        ),
        migrations.AlterField(
            model_name='stateretentionpolicy',
            name='purge_after_days',
            field=models.PositiveIntegerField(help_text='Delete rows of this kind this many days after they were superseded (facts), recorded (episodes), settled (obligations) or taken (coverage readings).'),
        ),
        migrations.AddIndex(
            model_name='coveragereading',
            index=models.Index(models.F('tenant'), models.F('operation'), django.db.models.functions.text.MD5('target'), models.F('account'), models.F('created_at'), models.F('id'), name='coverage_latest_idx'),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='coveragereading',
            trigger=pgtrigger.compiler.Trigger(name='coverage_reading_append_only', sql=ledger.models.triggers.UnbypassableTriggerSql(func="\n    IF TG_OP = 'DELETE' AND ledger_sanctioned(TG_RELID) AND EXISTS (SELECT 1 FROM ledger_coveragereading n WHERE n.tenant = OLD.tenant AND n.operation = OLD.operation AND md5(n.target) = md5(OLD.target) AND n.target = OLD.target AND n.account = OLD.account AND (n.created_at, n.id) > (OLD.created_at, OLD.id)) THEN\n        RETURN OLD;\n    END IF;\n    RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',\n        MESSAGE = format('coverage reading %s (%s on %s): expected readings never to change '\n                         'and only the retention purge to delete one, never the latest of its '\n                         'target, operation and account, found %s of %s', OLD.id,\n                         OLD.operation, OLD.target, TG_OP,\n                         CASE WHEN EXISTS (SELECT 1 FROM ledger_coveragereading n WHERE n.tenant = OLD.tenant AND n.operation = OLD.operation AND md5(n.target) = md5(OLD.target) AND n.target = OLD.target AND n.account = OLD.account AND (n.created_at, n.id) > (OLD.created_at, OLD.id)) THEN 'an older reading'\n                              ELSE 'the latest reading' END);\n", hash='d2c0c74a3db298f4487327bab7e1bb53cb7d86a0', operation='UPDATE OR DELETE', pgid='pgtrigger_coverage_reading_append_only_0a0e4', table='ledger_coveragereading', when='BEFORE')),
        ),
        migrations.AddConstraint(
            model_name='stateretentionpolicy',
            constraint=models.CheckConstraint(condition=models.Q(('kind__in', ['facts', 'episodes', 'obligations', 'coverage'])), name='state_retention_kind_known'),
        ),
        migrations.RunSQL(PURGE_STATE, _PREVIOUS.PURGE_STATE),
        migrations.RunPython(create_default_policy, delete_coverage_policies),
    ]
