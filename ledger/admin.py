from django.contrib import admin

from ledger.models import Evidence, Lease, Operation, OperationEvent, Run, Step, TenantAccess


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


# --- execution state: facts, conflicts, decisions, obligations, episodes (read-only; they
# change only through ledger.facts, ledger.obligations and ledger.episodes) ---------------

from ledger.models import Episode, Fact, FactConflict, FactDecision, Obligation  # noqa: E402


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
