from django.urls import path

from review import (
    views,
    views_approvals,
    views_charts,
    views_desk,
    views_execution,
    views_notifications,
    views_outcome_policies,
    views_retention,
    views_saved,
)

app_name = "review"

urlpatterns = [
    path("", views.queue, name="queue"),
    path("live/", views.queue_live, name="queue_live"),
    path("next/", views.queue_next, name="queue_next"),
    path("overview/", views_charts.overview, name="overview"),
    path("bulk/", views.bulk_resolve, name="bulk_resolve"),
    path("operations/<str:operation_id>/", views.operation_detail, name="operation"),
    path("operations/<str:operation_id>/resolve/", views.resolve, name="resolve"),
    path("operations/<str:operation_id>/acknowledge/", views.acknowledge, name="acknowledge"),
    path("audit/", views.audit, name="audit"),
    path("audit/export.csv", views.audit_csv, name="audit_csv"),
]

# Retention (admins): review/views_retention.py
urlpatterns += [
    path("retention/", views_retention.retention_page, name="retention"),
    path("retention/policies/", views_retention.add_policy, name="retention_add"),
    path("retention/policies/<int:pk>/", views_retention.edit_policy, name="retention_edit"),
    path("retention/policies/<int:pk>/delete/", views_retention.delete_policy,
         name="retention_delete"),
    path("retention/state-policies/", views_retention.add_state_policy,
         name="retention_state_add"),
    path("retention/state-policies/<int:pk>/", views_retention.edit_state_policy,
         name="retention_state_edit"),
    path("retention/state-policies/<int:pk>/delete/", views_retention.delete_state_policy,
         name="retention_state_delete"),
]

# Execution state: fact conflicts, overdue obligations, runs (review/views_execution.py).
urlpatterns += [
    path("conflicts/", views_execution.conflicts, name="conflicts"),
    path("conflicts/<int:conflict_id>/", views_execution.conflict_detail, name="conflict"),
    path("conflicts/<int:conflict_id>/resolve/", views_execution.resolve_conflict,
         name="resolve_conflict"),
    path("facts/<int:fact_id>/", views_execution.fact_detail, name="fact"),
    path("facts/<int:fact_id>/correct/", views_execution.correct_fact, name="correct_fact"),
    path("obligations/overdue/", views_execution.overdue, name="overdue"),
    path("coverage/", views_execution.coverage, name="coverage"),
    path("runs/<path:run_id>/", views_execution.run_detail, name="run"),
]

# Approval before the call (review/views_approvals.py); policies are for admins.
urlpatterns += [
    path("approvals/", views_approvals.awaiting, name="awaiting"),
    path("operations/<str:operation_id>/approval/", views_approvals.decide,
         name="approval_decide"),
    path("approvals/policies/", views_approvals.policies, name="approval_policies"),
    path("approvals/policies/set/", views_approvals.set_policy, name="approval_policy_set"),
]

# Unknown-outcome policies per kind of operation (review/views_outcome_policies.py): admins.
urlpatterns += [
    path("outcome-policies/", views_outcome_policies.policies, name="outcome_policies"),
    path("outcome-policies/set/", views_outcome_policies.set_policy,
         name="outcome_policy_set"),
]

# Claims and notes on an operation (review/views_desk.py).
urlpatterns += [
    path("operations/<str:operation_id>/claim/", views_desk.claim, name="claim"),
    path("operations/<str:operation_id>/release/", views_desk.release, name="release"),
    path("operations/<str:operation_id>/notes/", views_desk.add_note, name="add_note"),
]

# Notification channels and their delivery log (admins): review/views_notifications.py.
urlpatterns += [
    path("notifications/", views_notifications.channels, name="notifications"),
    path("notifications/channels/", views_notifications.add_channel,
         name="notification_add"),
    path("notifications/channels/<int:pk>/active/", views_notifications.set_active,
         name="notification_active"),
    path("notifications/deliveries/", views_notifications.deliveries,
         name="notification_deliveries"),
]

# Saved views of the queue (review/views_saved.py).
urlpatterns += [
    path("views/", views_saved.saved_views_page, name="saved_views"),
    path("views/save/", views_saved.save_view, name="save_view"),
    path("views/<int:view_id>/delete/", views_saved.delete_view, name="delete_view"),
]
