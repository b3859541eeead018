"""Django's admin over the ledger's tables.

Every ledger model's admin is tenant-scoped (`TenantScoped`): a user who is not a superuser
lists, opens and changes only the rows of the tenants granted to them (`ledger.access`),
and the fields that name a row are read-only. Rows change only through the ledger API, so
most admins only read; tenant grants go through `ledger.access.grant` / `revoke`, which
audit them, and retention policies through `ledger.retention`.
"""

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.options import csrf_protect_m
from django.core.exceptions import PermissionDenied
from django.db.models import Exists, OuterRef, Q, Value
from django.db.models.functions import Concat, Replace, Substr
from django.template.response import TemplateResponse

from ledger import access, agent_keys, retention
from ledger.canonical import scrub_text
from ledger.errors import LedgerError
from ledger.models import (
    AgentKey,
    AgentKeyChange,
    Approval,
    ApprovalPolicy,
    ApprovalPolicyChange,
    ApprovalRequest,
    AuditVerification,
    ChainAnchor,
    ChainHead,
    DeliveryAttempt,
    Episode,
    Evidence,
    Fact,
    FactConflict,
    FactDecision,
    Lease,
    NotificationBatch,
    NotificationChannel,
    NotificationChannelChange,
    NotificationSent,
    Obligation,
    Operation,
    OperationEvent,
    PurgeRun,
    Redaction,
    ResolutionProposal,
    RetentionChange,
    RetentionPolicy,
    Run,
    Step,
    TenantAccess,
    TenantAccessChange,
    UnknownOutcomePolicy,
    UnknownOutcomePolicyChange,
)


class TenantScoped:
    """Admin mixin: a user who is not a superuser sees only the rows of their tenants.

    The changelist, its filters and search, the change form, history and delete all read
    through `get_queryset`, so another tenant's row is neither listed nor opened: its URL
    answers like a missing row. `tenant_lookup` is the path from a row to its tenant
    (`"operation__tenant"` for evidence, `"run__tenant"` for steps); `tenant_filter` says
    more for rows that store their tenant otherwise. A tenant typed into a form must be
    one of the user's (`assignable_tenants`). `identity_fields` name the row: read-only
    once it exists.
    """

    tenant_lookup = "tenant"
    identity_fields: tuple[str, ...] = ()

    def tenant_filter(self, tenants: frozenset[str]) -> Q:
        return Q(**{f"{self.tenant_lookup}__in": tenants})

    def assignable_tenants(self, tenants: frozenset[str]) -> frozenset[str]:
        return tenants

    def get_queryset(self, request):
        queryset = super().get_queryset(request)
        tenants = access.tenants_for(request.user)
        return queryset if tenants is None else queryset.filter(self.tenant_filter(tenants))

    def get_readonly_fields(self, request, obj=None):
        fields = list(super().get_readonly_fields(request, obj))
        if obj is not None:
            fields += [name for name in self.identity_fields if name not in fields]
        return fields

    def get_form(self, request, obj=None, **kwargs):
        form = super().get_form(request, obj, **kwargs)
        tenants = access.tenants_for(request.user)
        if tenants is None or "tenant" not in form.base_fields:
            return form
        allowed = self.assignable_tenants(tenants)
        username = request.user.get_username()

        def clean_tenant(self):
            tenant = self.cleaned_data.get("tenant")
            if tenant not in allowed:
                raise forms.ValidationError(
                    f"expected one of the tenants granted to {username} "
                    f"({', '.join(sorted(t or 'every tenant' for t in allowed)) or 'none'}), "
                    f"found {tenant!r}"
                )
            return tenant

        return type(form.__name__, (form,), {"clean_tenant": clean_tenant})


class ReadOnlyAdmin(TenantScoped, admin.ModelAdmin):
    """Append-only records: visible to admins, never editable from here."""

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


class EventInline(admin.TabularInline):
    model = OperationEvent
    fields = ["version", "from_state", "to_state", "actor_kind", "actor_id", "reason",
              "created_at"]
    readonly_fields = fields
    extra = 0
    can_delete = False
    ordering = ["version"]

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Operation)
class OperationAdmin(ReadOnlyAdmin):
    """Operations change state only through the ledger API, so the admin only reads them."""

    list_display = ["operation_id", "tenant", "operation", "state", "attempt", "external_id",
                    "created_at"]
    list_filter = ["state", "tenant", "retry_policy"]
    search_fields = ["=operation_id", "=external_id", "=idempotency_key"]
    show_full_result_count = False
    date_hierarchy = None
    inlines = [EventInline]
    identity_fields = ("operation_id", "tenant", "operation", "idempotency_key",
                       "intent_fingerprint", "run", "step", "created_at")


@admin.register(OperationEvent)
class OperationEventAdmin(ReadOnlyAdmin):
    list_display = ["operation", "version", "from_state", "to_state", "actor_kind", "actor_id",
                    "created_at"]
    list_filter = ["to_state", "actor_kind"]
    list_select_related = ["operation"]
    show_full_result_count = False
    identity_fields = ("operation", "tenant", "version", "chain_seq", "chain_hash")


@admin.register(Evidence)
class EvidenceAdmin(ReadOnlyAdmin):
    list_display = ["operation", "reconciler", "verdict", "matched_by", "created_at"]
    list_filter = ["verdict"]
    list_select_related = ["operation"]
    tenant_lookup = "operation__tenant"
    identity_fields = ("operation",)


@admin.register(Lease)
class LeaseAdmin(ReadOnlyAdmin):
    """A lease names its run (`run:<tenant>:<run_id>`, `Run.lease_resource`) or the
    operation being reconciled (`reconcile:<operation_id>`); a lease on any other resource
    has no tenant, and only superusers see it."""

    list_display = ["resource", "owner", "token", "acquired_at", "expires_at"]
    identity_fields = ("resource", "owner", "token")

    def tenant_filter(self, tenants):
        runs = Run.objects.filter(tenant__in=tenants).annotate(lease=Concat(
            Value("run:"),
            Replace(Replace("tenant", Value("%"), Value("%25")), Value(":"), Value("%3A")),
            Value(":"), "run_id",
        )).filter(lease=OuterRef("resource"))
        operations = Operation.objects.filter(
            tenant__in=tenants,
            operation_id=Substr(OuterRef("resource"), len("reconcile:") + 1),
        )
        return (Q(resource__startswith="run:") & Exists(runs)) | (
            Q(resource__startswith="reconcile:") & Exists(operations))


@admin.register(Run)
class RunAdmin(TenantScoped, admin.ModelAdmin):
    """Only the objective may be edited: run_id and tenant decide who sees the run's
    operations, so they never change here."""

    list_display = ["run_id", "tenant", "objective", "created_at"]
    search_fields = ["=run_id"]
    identity_fields = ("run_id", "tenant", "created_at")

    def save_model(self, request, obj, form, change):
        obj.objective = scrub_text(obj.objective)
        super().save_model(request, obj, form, change)


@admin.register(Step)
class StepAdmin(ReadOnlyAdmin):
    list_display = ["run", "step_id", "state", "created_at", "started_at", "committed_at"]
    list_filter = ["state"]
    list_select_related = ["run"]
    tenant_lookup = "run__tenant"
    identity_fields = ("run", "step_id")


@admin.register(TenantAccess)
class TenantAccessAdmin(TenantScoped, admin.ModelAdmin):
    """Grants are added and deleted through ledger.access, which audits each change; a
    grant is never edited (revoke it and grant another). A user who is not a superuser
    grants only tenants granted to them."""

    list_display = ["user", "tenant", "granted_at"]
    list_filter = ["tenant"]
    list_select_related = ["user"]
    autocomplete_fields = ["user"]
    identity_fields = ("user", "tenant")

    def has_change_permission(self, request, obj=None):
        return False

    def save_model(self, request, obj, form, change):
        # The add view checked the permission and the form the tenant: grant's own checks.
        obj.pk = access.grant(obj.user, obj.tenant, by=request.user).pk

    def delete_model(self, request, obj):
        self._revoke(request, [obj])

    def delete_queryset(self, request, queryset):
        self._revoke(request, queryset.select_related("user"))

    def _revoke(self, request, grants):
        for grant in grants:
            try:
                access.revoke(grant.user, grant.tenant, by=request.user)
            except LedgerError as exc:
                self.message_user(request, str(exc), messages.ERROR)


@admin.register(TenantAccessChange)
class TenantAccessChangeAdmin(ReadOnlyAdmin):
    list_display = ["changed_at", "changed_by_name", "action", "username", "tenant"]
    list_filter = ["action", "tenant"]
    search_fields = ["=username", "=changed_by_name"]


# --- retention and tamper evidence -------------------------------------------------------


class RetentionPolicyForm(forms.ModelForm):
    class Meta:
        model = RetentionPolicy
        fields = ["pattern", "tenant", "purge_after_days", "redact_after_days",
                  "keep_events_days"]

    def clean(self):
        cleaned = super().clean()
        # The same rules set_policy applies, as form errors rather than a failed save.
        try:
            retention.check_policy_values(
                cleaned.get("pattern"), cleaned.get("tenant") or "",
                cleaned.get("purge_after_days"), cleaned.get("redact_after_days"),
                cleaned.get("keep_events_days"),
            )
        except LedgerError as exc:
            raise forms.ValidationError(str(exc)) from exc
        return cleaned


def _with_every_tenant(tenants: frozenset[str]) -> frozenset[str]:
    # A retention policy (and its audit, its purge runs) with tenant "" covers every
    # tenant, so each granted user sees it; a user with no grant sees nothing.
    return tenants | {""} if tenants else tenants


@admin.register(RetentionPolicy)
class RetentionPolicyAdmin(TenantScoped, admin.ModelAdmin):
    """Every save and delete goes through ledger.retention, which audits it. Users who
    are not superusers see the policies of their tenants and those of every tenant."""

    form = RetentionPolicyForm
    list_display = ["pattern", "tenant", "purge_after_days", "redact_after_days",
                    "keep_events_days", "updated_by", "updated_at"]
    list_select_related = ["updated_by"]
    actions = None  # bulk delete would skip the audit
    # Pattern and tenant name the policy; changing them is a new policy.
    identity_fields = ("pattern", "tenant")

    def tenant_filter(self, tenants):
        return Q(tenant__in=_with_every_tenant(tenants))

    def assignable_tenants(self, tenants):
        return _with_every_tenant(tenants)

    # ledger.retention opens its own durable transaction, so these views must not wrap
    # the save in the admin's usual atomic block.
    @csrf_protect_m
    def changeform_view(self, request, object_id=None, form_url="", extra_context=None):
        return self._changeform_view(request, object_id, form_url, extra_context)

    @csrf_protect_m
    def delete_view(self, request, object_id, extra_context=None):
        return self._delete_view(request, object_id, extra_context)

    def save_model(self, request, obj, form, change):
        saved = retention.set_policy(
            obj.pattern, tenant=obj.tenant, purge_after_days=obj.purge_after_days,
            redact_after_days=obj.redact_after_days, keep_events_days=obj.keep_events_days,
            user=request.user,
        )
        obj.pk = saved.pk

    def has_delete_permission(self, request, obj=None):
        if obj is not None and obj.is_default:
            return False
        return super().has_delete_permission(request, obj)

    def delete_model(self, request, obj):
        try:
            retention.delete_policy(obj, user=request.user)
        except LedgerError as exc:
            self.message_user(request, str(exc), messages.ERROR)


@admin.register(RetentionChange)
class RetentionChangeAdmin(ReadOnlyAdmin):
    list_display = ["changed_at", "changed_by_name", "action", "before", "after"]
    list_filter = ["action"]

    def tenant_filter(self, tenants):
        tenants = _with_every_tenant(tenants)
        return Q(before__tenant__in=tenants) | Q(after__tenant__in=tenants)


@admin.register(PurgeRun)
class PurgeRunAdmin(ReadOnlyAdmin):
    list_display = ["started_at", "finished_at", "dry_run", "actor", "policy_snapshot",
                    "operations_purged", "events_purged", "operations_redacted",
                    "first_operation_id", "last_operation_id"]
    list_filter = ["dry_run"]

    def tenant_filter(self, tenants):
        return Q(policy_snapshot__tenant__in=_with_every_tenant(tenants))

    def get_list_display(self, request):
        return _without_operation_ranges(request, super().get_list_display(request))

    def get_fields(self, request, obj=None):
        return _without_operation_ranges(request, super().get_fields(request, obj))


def _without_operation_ranges(request, fields):
    # A purge under an every-tenant policy spans every tenant's operation ids; as on the
    # desk's retention page, only superusers see the range.
    if request.user.is_superuser:
        return fields
    return [name for name in fields if name not in ("first_operation_id", "last_operation_id")]


@admin.register(Redaction)
class RedactionAdmin(ReadOnlyAdmin):
    list_display = ["operation_ref", "tenant", "intent_fingerprint", "evidence_rows",
                    "redacted_at"]
    search_fields = ["=operation_ref"]
    identity_fields = ("operation_ref", "tenant")


@admin.register(ChainHead)
class ChainHeadAdmin(ReadOnlyAdmin):
    list_display = ["chain", "tenant", "seq", "hash"]
    identity_fields = ("chain", "tenant")


@admin.register(ChainAnchor)
class ChainAnchorAdmin(ReadOnlyAdmin):
    list_display = ["chain", "tenant", "seq", "hash", "purge_run", "created_at"]
    identity_fields = ("chain", "tenant", "seq")


@admin.register(AuditVerification)
class AuditVerificationAdmin(ReadOnlyAdmin):
    """A verification covers every tenant's chains (its heads name them all): superusers
    only. The desk shows each user the verification of their own tenants' chains."""

    list_display = ["finished_at", "actor", "is_intact", "links_checked", "first_break"]

    def tenant_filter(self, tenants):
        return Q(pk__in=[])

# --- execution state: facts, conflicts, decisions, obligations, episodes (read-only; they
# change only through ledger.facts, ledger.obligations and ledger.episodes) ---------------


@admin.register(Fact)
class FactAdmin(ReadOnlyAdmin):
    list_display = ["subject", "predicate", "version", "status", "source", "observed_at",
                    "tenant"]
    list_filter = ["status", "tenant"]
    search_fields = ["=subject", "predicate"]
    list_select_related = ["run"]
    show_full_result_count = False
    identity_fields = ("tenant", "subject", "predicate", "version", "run")


@admin.register(FactConflict)
class FactConflictAdmin(ReadOnlyAdmin):
    list_display = ["subject", "predicate", "state", "created_at", "resolved_by", "resolved_at"]
    list_filter = ["state", "tenant"]
    list_select_related = ["resolved_by"]
    identity_fields = ("tenant", "subject", "predicate", "current", "candidate")


@admin.register(FactDecision)
class FactDecisionAdmin(ReadOnlyAdmin):
    list_display = ["conflict", "username", "chosen", "reason", "created_at"]
    list_select_related = ["conflict", "chosen"]
    identity_fields = ("tenant", "conflict")


@admin.register(Obligation)
class ObligationAdmin(ReadOnlyAdmin):
    list_display = ["key", "kind", "state", "run", "deadline", "committed_at", "tenant"]
    list_filter = ["state", "tenant"]
    search_fields = ["=key"]
    list_select_related = ["run"]
    identity_fields = ("run", "tenant", "kind", "key")


@admin.register(Episode)
class EpisodeAdmin(ReadOnlyAdmin):
    list_display = ["run", "role", "content_ref", "created_at"]
    list_filter = ["role"]
    list_select_related = ["run"]
    identity_fields = ("run", "tenant")


# --- agent keys: created and revoked only through ledger.agent_keys (audited); the hash is
# never shown -----------------------------------------------------------------------------


class NewAgentKeyForm(forms.Form):
    name = forms.CharField(max_length=100, help_text="The agent's name: the actor recorded "
                           "on every event its key causes.")
    tenants = forms.CharField(max_length=2000, help_text="Tenants the key may see and write, "
                              "separated by commas.")

    def clean_tenants(self):
        return [t.strip() for t in self.cleaned_data["tenants"].split(",") if t.strip()]


class KeyTenantsScoped(TenantScoped):
    """A key (or its audit row) is visible to a user granted every tenant it names."""

    def tenant_filter(self, tenants: frozenset[str]) -> Q:
        return Q(tenants__contained_by=sorted(tenants))


@admin.register(AgentKey)
class AgentKeyAdmin(KeyTenantsScoped, admin.ModelAdmin):
    list_display = ["name", "prefix", "tenant_list", "created_by_name", "created_at",
                    "revoked_at", "revoked_by_name"]
    list_filter = [("revoked_at", admin.EmptyFieldListFilter)]
    search_fields = ["name"]
    fields = ["name", "prefix", "tenants", "created_by_name", "created_at", "revoked_at",
              "revoked_by_name"]
    readonly_fields = fields
    actions = ["revoke_keys"]

    @admin.display(description="tenants")
    def tenant_list(self, key):
        return ", ".join(key.tenants)

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False  # revoke instead: a key's name stays in the audit trail

    def has_revoke_permission(self, request):
        return request.user.has_perm("ledger.change_agentkey")

    @admin.action(description="Revoke the selected keys", permissions=["revoke"])
    def revoke_keys(self, request, queryset):
        for key in queryset:
            try:
                agent_keys.revoke(key.name, user=request.user)
            except LedgerError as exc:
                self.message_user(request, str(exc), messages.ERROR)
                return
        self.message_user(request, f"Revoked {len(queryset)} key(s).", messages.SUCCESS)

    def add_view(self, request, form_url="", extra_context=None):
        """Creates the key and shows its secret in this one response: never in a message,
        a session or a log, and never again."""
        if not self.has_add_permission(request):
            raise PermissionDenied
        form = NewAgentKeyForm(request.POST or None)
        key = secret = None
        if request.method == "POST" and form.is_valid():
            try:
                key, secret = agent_keys.create(
                    form.cleaned_data["name"], tenants=form.cleaned_data["tenants"],
                    user=request.user,
                )
            except LedgerError as exc:
                form.add_error(None, str(exc))
        context = {
            **self.admin_site.each_context(request),
            "title": "Add agent key", "opts": self.opts, "form": form, "key": key,
            "secret": secret,
        }
        # The admin site's views are never_cache: the page with the secret is not stored.
        return TemplateResponse(request, "admin/ledger/agentkey/add.html", context)


@admin.register(AgentKeyChange)
class AgentKeyChangeAdmin(KeyTenantsScoped, ReadOnlyAdmin):
    list_display = ["changed_at", "changed_by_name", "action", "key_name", "tenants"]
    list_filter = ["action"]
    search_fields = ["key_name"]


# Approvals (ledger.approvals): decided on the desk, policies set on its Policies page
# (which audits each change); here they are only read.
@admin.register(ApprovalPolicy)
class ApprovalPolicyAdmin(ReadOnlyAdmin):
    list_display = ["pattern", "tenant", "requires_approval", "approvals_needed",
                    "approval_ttl", "consequential", "updated_at"]
    list_select_related = ["updated_by"]


@admin.register(ApprovalPolicyChange)
class ApprovalPolicyChangeAdmin(ReadOnlyAdmin):
    list_display = ["pattern", "tenant", "changed_by_name", "changed_at"]
    list_select_related = ["changed_by"]


# Unknown-outcome policies (ledger.outcome_policies): set on the desk's "Unknown outcomes"
# page, which audits each change with its reason; here they are only read.
@admin.register(UnknownOutcomePolicy)
class UnknownOutcomePolicyAdmin(ReadOnlyAdmin):
    list_display = ["pattern", "tenant", "automatic_retry", "attempts", "not_yet_window",
                    "updated_at"]
    list_select_related = ["updated_by"]


@admin.register(UnknownOutcomePolicyChange)
class UnknownOutcomePolicyChangeAdmin(ReadOnlyAdmin):
    list_display = ["pattern", "tenant", "changed_by_name", "changed_at", "reason"]
    list_select_related = ["changed_by"]


@admin.register(ApprovalRequest)
class ApprovalRequestAdmin(ReadOnlyAdmin):
    list_display = ["operation", "tenant", "status", "approvals_needed", "requested_at"]
    list_select_related = ["operation"]
    identity_fields = ("operation",)


@admin.register(Approval)
class ApprovalAdmin(ReadOnlyAdmin):
    list_display = ["operation", "decision", "decided_by_name", "intent_fingerprint",
                    "version", "expires_at", "created_at"]
    list_select_related = ["operation", "decided_by"]
    identity_fields = ("operation",)


@admin.register(ResolutionProposal)
class ResolutionProposalAdmin(ReadOnlyAdmin):
    list_display = ["operation", "to_state", "proposed_by_name", "version", "created_at"]
    list_select_related = ["operation", "proposed_by"]
    identity_fields = ("operation",)


# Notifications (ledger.notifications): channels are set on the desk's Notifications page
# (which audits each change); here they and their deliveries are only read.
@admin.register(NotificationChannel)
class NotificationChannelAdmin(ReadOnlyAdmin):
    list_display = ["name", "tenant", "kind", "pattern", "is_active", "updated_at"]
    list_filter = ["kind", "is_active"]
    list_select_related = ["updated_by"]
    identity_fields = ("name",)


@admin.register(NotificationChannelChange)
class NotificationChannelChangeAdmin(ReadOnlyAdmin):
    list_display = ["channel", "tenant", "changed_by_name", "changed_at"]
    list_select_related = ["channel", "changed_by"]


@admin.register(NotificationBatch)
class NotificationBatchAdmin(ReadOnlyAdmin):
    list_display = ["id", "channel", "tenant", "item_count", "status", "attempts",
                    "created_at", "delivered_at"]
    list_filter = ["status"]
    list_select_related = ["channel"]


@admin.register(NotificationSent)
class NotificationSentAdmin(ReadOnlyAdmin):
    tenant_lookup = "channel__tenant"
    list_display = ["item_key", "reason", "channel", "batch", "created_at"]
    list_filter = ["reason"]
    list_select_related = ["channel", "batch", "batch__channel"]


@admin.register(DeliveryAttempt)
class DeliveryAttemptAdmin(ReadOnlyAdmin):
    list_display = ["started_at", "channel", "tenant", "batch", "attempt", "is_ok",
                    "status_code", "duration_ms"]
    list_filter = ["is_ok"]
    list_select_related = ["channel", "batch", "batch__channel"]
