"""Retention policies (with a default row), their audit, purge runs, and hash-chained events.

Existing events are chained in the order they were written (created_at, id) per tenant, so
`manage.py verify_audit` passes on a database that predates the chain.
"""

import django.db.models.deletion
import pgtrigger.compiler
import pgtrigger.migrations
from django.conf import settings
from django.db import migrations, models

DEFAULT_POLICY = {"pattern": "*", "tenant": "", "purge_after_days": 365,
                  "redact_after_days": 90, "keep_events_days": 365}
ADMIN_PERMS = [
    "view_retentionpolicy", "add_retentionpolicy", "change_retentionpolicy",
    "delete_retentionpolicy", "view_retentionchange", "view_purgerun", "view_redaction",
    "view_chainanchor",
]
EVERY_ROLE_PERMS = ["view_chainhead", "view_auditverification"]


def chain_existing_events(apps, schema_editor):
    import pgtrigger
    from django.db.models import F

    from ledger.chain import GENESIS, OPERATION_EVENTS, link_hash

    OperationEvent = apps.get_model("ledger", "OperationEvent")
    ChainHead = apps.get_model("ledger", "ChainHead")
    heads = {}
    events = OperationEvent.objects.annotate(operation_ref=F("operation__operation_id"))
    with pgtrigger.ignore("ledger.OperationEvent:event_append_only"):
        for event in events.order_by("tenant", "created_at", "id").iterator():
            seq, prev = heads.get(event.tenant, (0, GENESIS))
            seq += 1
            digest = link_hash(OPERATION_EVENTS.payload(event), prev=prev, seq=seq)
            OperationEvent.objects.filter(pk=event.pk).update(chain_seq=seq, chain_hash=digest)
            heads[event.tenant] = (seq, digest)
    for tenant, (seq, digest) in heads.items():
        ChainHead.objects.create(chain=OPERATION_EVENTS.name, tenant=tenant, seq=seq,
                                 hash=digest)


def create_default_policy_and_permissions(apps, schema_editor):
    from django.contrib.auth.management import create_permissions
    from django.utils import timezone

    for app_config in apps.get_app_configs():
        app_config.models_module = True
        create_permissions(app_config, apps=apps, verbosity=0)
        app_config.models_module = None
    Group = apps.get_model("auth", "Group")
    Permission = apps.get_model("auth", "Permission")
    for name in ("viewer", "reviewer", "admin"):
        codenames = EVERY_ROLE_PERMS + (ADMIN_PERMS if name == "admin" else [])
        group, _ = Group.objects.get_or_create(name=name)
        group.permissions.add(*Permission.objects.filter(
            content_type__app_label="ledger", codename__in=codenames))

    now = timezone.now()
    RetentionPolicy = apps.get_model("ledger", "RetentionPolicy")
    RetentionChange = apps.get_model("ledger", "RetentionChange")
    policy, created = RetentionPolicy.objects.get_or_create(
        pattern="*", tenant="", defaults={**DEFAULT_POLICY, "created_at": now, "updated_at": now})
    if created:
        RetentionChange.objects.create(
            policy_id=policy.pk, action="created", changed_by_name="migration 0004_retention",
            before=None, after=DEFAULT_POLICY, changed_at=now)


class Migration(migrations.Migration):

    dependencies = [
        ('ledger', '0003_execution'),
        ('auth', '0012_alter_user_first_name_max_length'),
        ('contenttypes', '0002_remove_content_type_name'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name='AuditVerification',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('actor', models.CharField(max_length=200)),
                ('started_at', models.DateTimeField()),
                ('finished_at', models.DateTimeField()),
                ('links_checked', models.PositiveBigIntegerField()),
                ('is_intact', models.BooleanField()),
                ('first_break', models.JSONField(blank=True, null=True)),
                ('heads', models.JSONField(default=list)),
            ],
            options={
                'ordering': ['-finished_at', '-id'],
            },
        ),
        migrations.CreateModel(
            name='ChainAnchor',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('chain', models.CharField(max_length=40)),
                ('tenant', models.CharField(max_length=100)),
                ('seq', models.BigIntegerField()),
                ('hash', models.CharField(max_length=64)),
                ('created_at', models.DateTimeField()),
            ],
            options={
                'ordering': ['chain', 'tenant', 'seq'],
            },
        ),
        migrations.CreateModel(
            name='ChainHead',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('chain', models.CharField(max_length=40)),
                ('tenant', models.CharField(max_length=100)),
                ('seq', models.BigIntegerField()),
                ('hash', models.CharField(max_length=64)),
            ],
            options={
                'ordering': ['chain', 'tenant'],
            },
        ),
        migrations.CreateModel(
            name='PurgeRun',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('policy_snapshot', models.JSONField()),
                ('dry_run', models.BooleanField(default=False)),
                ('actor', models.CharField(max_length=200)),
                ('batch_size', models.PositiveIntegerField()),
                ('operations_purged', models.PositiveIntegerField(default=0)),
                ('events_purged', models.PositiveIntegerField(default=0)),
                ('evidence_purged', models.PositiveIntegerField(default=0)),
                ('operations_redacted', models.PositiveIntegerField(default=0)),
                ('evidence_redacted', models.PositiveIntegerField(default=0)),
                ('first_operation_id', models.CharField(blank=True, max_length=40)),
                ('last_operation_id', models.CharField(blank=True, max_length=40)),
                ('started_at', models.DateTimeField()),
                ('finished_at', models.DateTimeField(blank=True, null=True)),
            ],
            options={
                'ordering': ['-started_at', '-id'],
            },
        ),
        migrations.CreateModel(
            name='Redaction',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('operation_ref', models.CharField(db_index=True, max_length=40)),
                ('tenant', models.CharField(max_length=100)),
                ('intent_fingerprint', models.CharField(max_length=80)),
                ('evidence_rows', models.PositiveIntegerField()),
                ('redacted_at', models.DateTimeField()),
            ],
            options={
                'ordering': ['-redacted_at', '-id'],
            },
        ),
        migrations.CreateModel(
            name='RetentionChange',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('action', models.CharField(choices=[('created', 'Created'), ('updated', 'Updated'), ('deleted', 'Deleted')], max_length=20)),
                ('changed_by_name', models.CharField(max_length=150)),
                ('before', models.JSONField(blank=True, null=True)),
                ('after', models.JSONField(blank=True, null=True)),
                ('changed_at', models.DateTimeField()),
            ],
            options={
                'ordering': ['-changed_at', '-id'],
            },
        ),
        migrations.CreateModel(
            name='RetentionPolicy',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('pattern', models.CharField(max_length=200)),
                ('tenant', models.CharField(blank=True, help_text='Empty: every tenant.', max_length=100)),
                ('purge_after_days', models.PositiveIntegerField(help_text='Delete terminal operations (with their events and evidence) this many days after completion.')),
                ('redact_after_days', models.PositiveIntegerField(blank=True, help_text='Replace the intent and evidence payloads this many days after completion; empty: never.', null=True)),
                ('keep_events_days', models.PositiveIntegerField(help_text="Keep an operation's audit events at least this many days after completion; an operation is purged only once both this and purge_after_days have passed.")),
                ('created_at', models.DateTimeField()),
                ('updated_at', models.DateTimeField()),
            ],
            options={
                'verbose_name_plural': 'retention policies',
                'ordering': ['pattern', 'tenant'],
            },
        ),
        migrations.AddField(
            model_name='evidence',
            name='redacted_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='operation',
            name='redacted_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='operationevent',
            name='chain_hash',
            field=models.CharField(max_length=64, null=True),
        ),
        migrations.AddField(
            model_name='operationevent',
            name='chain_seq',
            field=models.BigIntegerField(null=True),
        ),
        migrations.RunPython(chain_existing_events, migrations.RunPython.noop),
        migrations.AlterField(
            model_name='operationevent',
            name='chain_hash',
            field=models.CharField(max_length=64),
        ),
        migrations.AlterField(
            model_name='operationevent',
            name='chain_seq',
            field=models.BigIntegerField(),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='operation',
            trigger=pgtrigger.compiler.Trigger(name='operation_delete_terminal_only', sql=pgtrigger.compiler.UpsertTriggerSql(func="\n    IF OLD.state NOT IN ('abandoned', 'rejected', 'succeeded') THEN\n        RAISE EXCEPTION USING ERRCODE = 'check_violation',\n            MESSAGE = format('operation %s: expected a terminal operation (abandoned, rejected, succeeded) '\n                             'to delete, found state %s; only the retention purge removes '\n                             'operations, and never unfinished ones', OLD.operation_id,\n                             OLD.state);\n    END IF;\n    RETURN OLD;\n", hash='f66e978b47a842d2bbf25eba5e64b7a2e1a15855', operation='DELETE', pgid='pgtrigger_operation_delete_terminal_only_4840c', table='ledger_operation', when='BEFORE')),
        ),
        migrations.AddConstraint(
            model_name='operationevent',
            constraint=models.UniqueConstraint(fields=('tenant', 'chain_seq'), name='event_chain_seq_unique'),
        ),
        migrations.AddConstraint(
            model_name='chainhead',
            constraint=models.UniqueConstraint(fields=('chain', 'tenant'), name='chain_head_unique'),
        ),
        migrations.AddField(
            model_name='chainanchor',
            name='purge_run',
            field=models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='anchors', to='ledger.purgerun'),
        ),
        migrations.AddField(
            model_name='redaction',
            name='purge_run',
            field=models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='redactions', to='ledger.purgerun'),
        ),
        migrations.AddField(
            model_name='retentionchange',
            name='changed_by',
            field=models.ForeignKey(db_constraint=False, null=True, on_delete=django.db.models.deletion.DO_NOTHING, related_name='+', to=settings.AUTH_USER_MODEL),
        ),
        migrations.AddField(
            model_name='retentionpolicy',
            name='created_by',
            field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to=settings.AUTH_USER_MODEL),
        ),
        migrations.AddField(
            model_name='retentionpolicy',
            name='updated_by',
            field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to=settings.AUTH_USER_MODEL),
        ),
        migrations.AddField(
            model_name='retentionchange',
            name='policy',
            field=models.ForeignKey(blank=True, db_constraint=False, null=True, on_delete=django.db.models.deletion.DO_NOTHING, related_name='changes', to='ledger.retentionpolicy'),
        ),
        migrations.AddField(
            model_name='purgerun',
            name='policy',
            field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='runs', to='ledger.retentionpolicy'),
        ),
        migrations.AddConstraint(
            model_name='chainanchor',
            constraint=models.UniqueConstraint(fields=('chain', 'tenant', 'seq'), name='chain_anchor_unique'),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='chainanchor',
            trigger=pgtrigger.compiler.Trigger(name='chain_anchor_append_only', sql=pgtrigger.compiler.UpsertTriggerSql(func="RAISE EXCEPTION 'pgtrigger: Cannot update or delete rows from % table', TG_TABLE_NAME;", hash='52707e18f9b247919e891f1fb64741c5008eebf7', operation='UPDATE OR DELETE', pgid='pgtrigger_chain_anchor_append_only_487fa', table='ledger_chainanchor', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='redaction',
            trigger=pgtrigger.compiler.Trigger(name='redaction_append_only', sql=pgtrigger.compiler.UpsertTriggerSql(func="RAISE EXCEPTION 'pgtrigger: Cannot update or delete rows from % table', TG_TABLE_NAME;", hash='05df7a9a0c6e65d2a85f132ff31567d2d7eb1f7a', operation='UPDATE OR DELETE', pgid='pgtrigger_redaction_append_only_4e7cc', table='ledger_redaction', when='BEFORE')),
        ),
        migrations.AddConstraint(
            model_name='retentionpolicy',
            constraint=models.UniqueConstraint(fields=('pattern', 'tenant'), name='retention_policy_unique'),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='retentionchange',
            trigger=pgtrigger.compiler.Trigger(name='retention_change_append_only', sql=pgtrigger.compiler.UpsertTriggerSql(func="RAISE EXCEPTION 'pgtrigger: Cannot update or delete rows from % table', TG_TABLE_NAME;", hash='4679ec29fc892fd403e3e445003492e89dc99977', operation='UPDATE OR DELETE', pgid='pgtrigger_retention_change_append_only_6506d', table='ledger_retentionchange', when='BEFORE')),
        ),
        migrations.RunPython(create_default_policy_and_permissions, migrations.RunPython.noop),
    ]
