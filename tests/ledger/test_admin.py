"""Django's admin keeps to tenant grants: rows, change forms, identity fields, grants."""

from datetime import timedelta

import pytest
from django.contrib import admin
from django.db import connection, transaction
from django.db.utils import ProgrammingError
from django.test import RequestFactory
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from ledger import (
    access,
    agent_keys,
    approvals,
    chain,
    episodes,
    facts,
    leases,
    notifications,
    obligations,
    outcome_policies,
    receipts,
    retention,
    runs,
)
from ledger.errors import PermissionDenied
from ledger.models import PurgeRun, Run, TenantAccess, TenantAccessChange
from ledger.states import State
from tests.factories import OperationFactory, UserFactory, add_evidence
from tests.support.retention import complete_days_ago

LEDGER_MODELS = [model for model in admin.site._registry if model._meta.app_label == "ledger"]
# Rows that belong to no single tenant, shown to superusers only.
SUPERUSER_ONLY = {"auditverification"}
# Besides `tenant` (read-only wherever a model has it): what else names a row.
IDENTITY = {
    "operation": {"operation_id", "operation", "idempotency_key", "intent_fingerprint"},
    "run": {"run_id"},
    "step": {"run", "step_id"},
    "fact": {"subject", "predicate", "version"},
    "factconflict": {"subject", "predicate", "current", "candidate"},
    "obligation": {"run", "kind", "key"},
    "evidence": {"operation"},
    "operationevent": {"operation", "version"},
    "tenantaccess": {"user"},
    "retentionpolicy": {"pattern"},
}


def populate(tenant: str, root) -> None:
    """One row or more of every ledger model for `tenant`, each naming the tenant, through
    the ledger API (the purge and the verification below add the rest)."""
    old = OperationFactory(tenant=tenant, state=State.SUCCEEDED, intent={"tenant": tenant})
    aging = OperationFactory(tenant=tenant, state=State.SUCCEEDED, intent={"n": 2})
    run = runs.start(f"work of {tenant}", tenant=tenant, run_id=f"run-{tenant}")
    runs.add_step(run, "send")
    token = leases.acquire(run.lease_resource, f"worker-{tenant}", timedelta(minutes=5))
    op = OperationFactory(tenant=tenant, state=State.OUTCOME_UNKNOWN, run=run,
                          intent={"tenant": tenant})
    add_evidence(op, verdict="not_yet", observed={"tenant": tenant})
    leases.acquire(f"reconcile:{op.operation_id}", f"reconciler-{tenant}", timedelta(minutes=5))
    facts.assert_fact(f"article-{tenant}", "status", "draft", source=f"cms-{tenant}",
                      tenant=tenant)
    candidate = facts.assert_fact(f"article-{tenant}", "status", "live",
                                  source=f"feed-{tenant}", tenant=tenant)
    facts.resolve_conflict(candidate.conflict, winner="candidate", user=root,
                           reason=f"checked {tenant}")
    obligations.open(run, "email.send", f"ob-{tenant}", fencing_token=token)
    episodes.record(run, "tool", content=f"said in {tenant}", fencing_token=token)
    access.grant(UserFactory(username=f"{tenant}-reader", tenants=[]), tenant, by=root)
    agent_keys.create(f"bot-{tenant}", tenants=[tenant], user=root)
    retention.set_policy("*", tenant=tenant, purge_after_days=30, redact_after_days=10,
                         user=root)
    approvals.set_policy(f"pay-{tenant}.*", tenant=tenant, user=root)
    outcome_policies.set_policy(f"pay-{tenant}.*", tenant=tenant, user=root,
                                automatic_retry=False, reason=f"never retried in {tenant}")
    gated = OperationFactory(tenant=tenant, operation=f"pay-{tenant}.send",
                             intent={"tenant": tenant})
    approvals.request(gated, note=f"paying in {tenant}")
    approvals.approve(gated, user=root, reason=f"checked {tenant}")
    # A proposal of the two-person rule (safe_to_retry on a `never` operation).
    never = OperationFactory(tenant=tenant, state=State.MANUAL_REVIEW, retry_policy="never")
    receipts.resolve(never, State.SAFE_TO_RETRY, user=root, reason=f"proposed in {tenant}")
    # A notification channel told about the manual_review operation above, by e-mail.
    notifications.create_channel(f"mail-{tenant}", user=root, kind="email", tenant=tenant,
                                 recipients=[f"oncall@{tenant}.example"])
    notifications.run_once(worker=f"notify-{tenant}")
    complete_days_ago(old, 31)
    complete_days_ago(aging, 15)


@pytest.fixture
def root(db):
    user = UserFactory(username="root", tenants=[])
    user.is_superuser = user.is_staff = True
    user.save()
    return user


@pytest.fixture
def two_tenants(root):
    populate("acme", root)
    populate("globex", root)
    retention.purge(actor="test")
    chain.verify(actor="test")


def staff(username="acme-admin", tenants=("acme",)):
    user = UserFactory(username=username, role="admin", tenants=list(tenants))
    user.is_staff = True
    user.save(update_fields=["is_staff"])
    return user


def change_url(obj):
    return reverse(f"admin:ledger_{obj._meta.model_name}_change", args=[obj.pk])


def changelist_url(model):
    return reverse(f"admin:ledger_{model._meta.model_name}_changelist")


@pytest.mark.django_db
def test_a_staff_user_granted_one_tenant_sees_none_of_another_tenants_rows(
        client, root, two_tenants):
    user = staff()  # before the oracle: its own grant is one of the rows
    client.force_login(root)
    pages = {}  # what a superuser sees of each row: the oracle of whose row it is
    for model in LEDGER_MODELS:
        for obj in model._default_manager.all():
            response = client.get(change_url(obj))
            assert response.status_code == 200
            pages[obj] = response.content.decode()

    client.force_login(user)
    for model in LEDGER_MODELS:
        listing = client.get(changelist_url(model))
        assert listing.status_code == 200, model
        listed = listing.content.decode()
        assert "globex" not in listed, f"{model.__name__} changelist shows globex"
        rows = [obj for obj in pages if type(obj) is model]
        hidden = [obj for obj in rows if "globex" in pages[obj]
                  or model._meta.model_name in SUPERUSER_ONLY]
        shown = [obj for obj in rows if obj not in hidden]
        assert hidden, f"expected the set-up to give {model.__name__} rows of globex"
        if model._meta.model_name not in SUPERUSER_ONLY:
            assert any("acme" in pages[obj] for obj in shown), model
        for obj in hidden:
            assert change_url(obj) not in listed
            opened = client.get(change_url(obj))
            assert opened.status_code == 302 and opened.url == reverse("admin:index"), obj
            assert client.get(reverse(
                f"admin:ledger_{model._meta.model_name}_history", args=[obj.pk])
            ).status_code == 302
        assert listing.context["cl"].result_count == len(shown), model
        for obj in shown:
            assert change_url(obj) in listed, obj
            assert client.get(change_url(obj)).status_code == 200


@pytest.mark.django_db
def test_a_staff_user_without_grants_sees_no_row_at_all(client, two_tenants):
    client.force_login(staff("nobody", tenants=()))
    for model in LEDGER_MODELS:
        listing = client.get(changelist_url(model))
        assert listing.context["cl"].result_count == 0, model
        assert "acme" not in listing.content.decode(), model


@pytest.mark.django_db
def test_each_changelist_makes_as_many_queries_for_many_rows_as_for_few(client, root,
                                                                        two_tenants):
    client.force_login(staff(tenants=("acme", "initech")))

    def queries():
        counts = {}
        for model in LEDGER_MODELS:
            with CaptureQueriesContext(connection) as captured:
                assert client.get(changelist_url(model)).status_code == 200
            counts[model.__name__] = len(captured)
        return counts

    few = queries()
    populate("initech", root)
    retention.purge(actor="test")
    assert queries() == few


@pytest.mark.django_db
def test_identity_fields_are_read_only_in_every_change_form(client, two_tenants):
    user = staff()
    client.force_login(user)
    request = RequestFactory().get("/")
    request.user = user
    for model in LEDGER_MODELS:
        model_admin = admin.site._registry[model]
        names = {f.name for f in model._meta.concrete_fields}
        wanted = IDENTITY.get(model._meta.model_name, set()) | ({"tenant"} & names)
        for obj in model_admin.get_queryset(request)[:3]:
            readonly = set(model_admin.get_readonly_fields(request, obj))
            editable = model_admin.has_change_permission(request, obj)
            assert not editable or wanted <= readonly, (model, wanted - readonly)
            page = client.get(change_url(obj)).content.decode()
            for name in wanted:
                assert f'name="{name}"' not in page, (model, name)


@pytest.mark.django_db
def test_a_runs_id_and_tenant_cannot_be_changed_and_its_objective_is_scrubbed(client,
                                                                              two_tenants):
    client.force_login(staff())
    run = Run.objects.get(run_id="run-acme")
    response = client.post(change_url(run), {
        "run_id": "hijacked", "tenant": "globex",
        "objective": "publish with password=ObjectiveQ7",
    })
    assert response.status_code == 302
    run.refresh_from_db()
    assert (run.run_id, run.tenant) == ("run-acme", "acme")
    assert run.objective == "publish with password=[redacted]"


@pytest.mark.django_db
def test_grants_made_in_the_admin_are_audited_and_limited_to_the_granters_tenants(client,
                                                                                  db):
    granter = staff()
    someone = UserFactory(username="someone", tenants=[])
    client.force_login(granter)
    add = reverse("admin:ledger_tenantaccess_add")

    refused = client.post(add, {"user": someone.pk, "tenant": "globex"})
    assert refused.status_code == 200
    assert "expected one of the tenants granted to acme-admin (acme), found" in (
        refused.content.decode())
    assert not TenantAccess.objects.filter(user=someone).exists()

    assert client.post(add, {"user": someone.pk, "tenant": "acme"}).status_code == 302
    grant = TenantAccess.objects.get(user=someone)
    granted = TenantAccessChange.objects.get(user=someone)
    assert (granted.action, granted.tenant, granted.username, granted.changed_by_id,
            granted.changed_by_name) == ("granted", "acme", "someone", granter.pk, "acme-admin")

    delete = reverse("admin:ledger_tenantaccess_delete", args=[grant.pk])
    assert client.post(delete, {"post": "yes"}).status_code == 302
    assert not TenantAccess.objects.filter(user=someone).exists()
    revoked = TenantAccessChange.objects.filter(user=someone).order_by("-id").first()
    assert (revoked.action, revoked.changed_by_name) == ("revoked", "acme-admin")


@pytest.mark.django_db
def test_bulk_deleting_grants_in_the_admin_revokes_each_one_audited(client, db):
    granter = staff()
    users = [UserFactory(username=f"reader{n}", tenants=[]) for n in range(3)]
    for user in users:
        access.grant(user, "acme", by=granter)
    client.force_login(granter)
    ids = list(TenantAccess.objects.filter(user__in=users).values_list("pk", flat=True))
    response = client.post(reverse("admin:ledger_tenantaccess_changelist"), {
        "action": "delete_selected", "_selected_action": ids, "post": "yes",
    })
    assert response.status_code == 302
    assert not TenantAccess.objects.filter(user__in=users).exists()
    changes = TenantAccessChange.objects.filter(user__in=users, action="revoked")
    assert sorted(changes.values_list("username", flat=True)) == ["reader0", "reader1",
                                                                  "reader2"]
    assert set(changes.values_list("changed_by_name", flat=True)) == {"acme-admin"}


@pytest.mark.django_db
def test_grant_and_revoke_audit_each_change_once_and_check_the_acting_person(root):
    user = UserFactory(username="someone", tenants=[])
    access.grant(user, "acme")  # the contract's two-argument form: code, no acting person
    access.grant(user, "acme", by=root)  # already granted: nothing changes, nothing audited
    assert access.revoke(user, "acme", by=root) is True
    assert access.revoke(user, "acme", by=root) is False
    trail = list(TenantAccessChange.objects.filter(user=user).order_by("id")
                 .values_list("action", "changed_by_name"))
    assert trail == [("granted", ""), ("revoked", "root")]

    viewer = UserFactory(username="plain-viewer", role="viewer", tenants=["acme"])
    with pytest.raises(PermissionDenied, match="expected permission ledger.add_tenantaccess"):
        access.grant(user, "acme", by=viewer)
    with pytest.raises(PermissionDenied, match="to be granted tenant 'globex'"):
        access.grant(user, "globex", by=staff())
    with pytest.raises(PermissionDenied, match="ledger.delete_tenantaccess"):
        access.revoke(user, "acme", by=viewer)
    assert not TenantAccess.objects.filter(user=user).exists()
    assert TenantAccessChange.objects.filter(user=user).count() == 2


@pytest.mark.django_db
@pytest.mark.parametrize("statement", [
    "UPDATE ledger_tenantaccesschange SET tenant = 'globex'",
    "DELETE FROM ledger_tenantaccesschange",
])
def test_the_access_trail_is_append_only_in_postgresql(root, statement):
    access.grant(UserFactory(username="someone", tenants=[]), "acme", by=root)
    with pytest.raises(ProgrammingError, match="Cannot update or delete"):
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(statement)
    assert TenantAccessChange.objects.get().tenant == "acme"


@pytest.mark.django_db
def test_purge_runs_show_their_operation_id_range_to_superusers_only(client, root,
                                                                     two_tenants):
    run = PurgeRun.objects.exclude(first_operation_id="").filter(
        policy_snapshot__tenant="acme").get()
    client.force_login(root)
    assert run.first_operation_id in client.get(change_url(run)).content.decode()
    client.force_login(staff())
    for url in (change_url(run), changelist_url(PurgeRun)):
        page = client.get(url)
        assert page.status_code == 200
        assert run.first_operation_id not in page.content.decode()
