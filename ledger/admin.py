from django import forms
from django.contrib import admin, messages
from django.contrib.admin.options import csrf_protect_m
from django.core.exceptions import PermissionDenied
from django.template.response import TemplateResponse

from ledger import agent_keys, retention
from ledger.errors import LedgerError
from ledger.models import (
    AgentKey,
    AgentKeyChange,
    AuditVerification,
    ChainAnchor,
    ChainHead,
    Episode,
    Evidence,
    Fact,
    FactConflict,
    FactDecision,
    Lease,
    Obligation,
    Operation,
    OperationEvent,
    PurgeRun,
    Redaction,
    RetentionChange,
    RetentionPolicy,
    Run,
    Step,
    TenantAccess,
)


class ReadOnlyAdmin(admin.ModelAdmin):
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


@admin.register(OperationEvent)
class OperationEventAdmin(ReadOnlyAdmin):
    list_display = ["operation", "version", "from_state", "to_state", "actor_kind", "actor_id",
                    "created_at"]
    list_filter = ["to_state", "actor_kind"]
    list_select_related = ["operation"]
    show_full_result_count = False


@admin.register(Evidence)
class EvidenceAdmin(ReadOnlyAdmin):
    list_display = ["operation", "reconciler", "verdict", "matched_by", "created_at"]
    list_filter = ["verdict"]
    list_select_related = ["operation"]


@admin.register(Lease)
class LeaseAdmin(ReadOnlyAdmin):
    list_display = ["resource", "owner", "token", "acquired_at", "expires_at"]


@admin.register(Run)
class RunAdmin(admin.ModelAdmin):
    list_display = ["run_id", "tenant", "objective", "created_at"]
    search_fields = ["=run_id"]


@admin.register(Step)
class StepAdmin(ReadOnlyAdmin):
    list_display = ["run", "step_id", "state", "created_at", "started_at", "committed_at"]
    list_filter = ["state"]
    list_select_related = ["run"]


@admin.register(TenantAccess)
class TenantAccessAdmin(admin.ModelAdmin):
    list_display = ["user", "tenant", "granted_at"]
    list_filter = ["tenant"]
    autocomplete_fields = ["user"]


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


@admin.register(RetentionPolicy)
class RetentionPolicyAdmin(admin.ModelAdmin):
    """Every save and delete goes through ledger.retention, which audits it."""

    form = RetentionPolicyForm
    list_display = ["pattern", "tenant", "purge_after_days", "redact_after_days",
                    "keep_events_days", "updated_by", "updated_at"]
    list_select_related = ["updated_by"]
    actions = None  # bulk delete would skip the audit

    # ledger.retention opens its own durable transaction, so these views must not wrap
    # the save in the admin's usual atomic block.
    @csrf_protect_m
    def changeform_view(self, request, object_id=None, form_url="", extra_context=None):
        return self._changeform_view(request, object_id, form_url, extra_context)

    @csrf_protect_m
    def delete_view(self, request, object_id, extra_context=None):
        return self._delete_view(request, object_id, extra_context)

    def get_readonly_fields(self, request, obj=None):
        # Pattern and tenant name the policy; changing them is a new policy.
        return ["pattern", "tenant"] if obj is not None else []

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


@admin.register(PurgeRun)
class PurgeRunAdmin(ReadOnlyAdmin):
    list_display = ["started_at", "finished_at", "dry_run", "actor", "policy_snapshot",
                    "operations_purged", "events_purged", "operations_redacted",
                    "first_operation_id", "last_operation_id"]
    list_filter = ["dry_run"]


@admin.register(Redaction)
class RedactionAdmin(ReadOnlyAdmin):
    list_display = ["operation_ref", "tenant", "intent_fingerprint", "evidence_rows",
                    "redacted_at"]
    search_fields = ["=operation_ref"]


@admin.register(ChainHead)
class ChainHeadAdmin(ReadOnlyAdmin):
    list_display = ["chain", "tenant", "seq", "hash"]


@admin.register(ChainAnchor)
class ChainAnchorAdmin(ReadOnlyAdmin):
    list_display = ["chain", "tenant", "seq", "hash", "purge_run", "created_at"]


@admin.register(AuditVerification)
class AuditVerificationAdmin(ReadOnlyAdmin):
    list_display = ["finished_at", "actor", "is_intact", "links_checked", "first_break"]

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


@admin.register(FactConflict)
class FactConflictAdmin(ReadOnlyAdmin):
    list_display = ["subject", "predicate", "state", "created_at", "resolved_by", "resolved_at"]
    list_filter = ["state", "tenant"]
    list_select_related = ["resolved_by"]


@admin.register(FactDecision)
class FactDecisionAdmin(ReadOnlyAdmin):
    list_display = ["conflict", "username", "chosen", "reason", "created_at"]
    list_select_related = ["conflict", "chosen"]


@admin.register(Obligation)
class ObligationAdmin(ReadOnlyAdmin):
    list_display = ["key", "kind", "state", "run", "deadline", "committed_at", "tenant"]
    list_filter = ["state", "tenant"]
    search_fields = ["=key"]
    list_select_related = ["run"]


@admin.register(Episode)
class EpisodeAdmin(ReadOnlyAdmin):
    list_display = ["run", "role", "content_ref", "created_at"]
    list_filter = ["role"]
    list_select_related = ["run"]


# --- agent keys: created and revoked only through ledger.agent_keys (audited); the hash is
# never shown -----------------------------------------------------------------------------


class NewAgentKeyForm(forms.Form):
    name = forms.CharField(max_length=100, help_text="The agent's name: the actor recorded "
                           "on every event its key causes.")
    tenants = forms.CharField(max_length=2000, help_text="Tenants the key may see and write, "
                              "separated by commas.")

    def clean_tenants(self):
        return [t.strip() for t in self.cleaned_data["tenants"].split(",") if t.strip()]


@admin.register(AgentKey)
class AgentKeyAdmin(admin.ModelAdmin):
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
class AgentKeyChangeAdmin(ReadOnlyAdmin):
    list_display = ["changed_at", "changed_by_name", "action", "key_name", "tenants"]
    list_filter = ["action"]
    search_fields = ["key_name"]
