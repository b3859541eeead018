from django.urls import path

from review import views

app_name = "review"

urlpatterns = [
    path("", views.queue, name="queue"),
    path("operations/<str:operation_id>/", views.operation_detail, name="operation"),
    path("operations/<str:operation_id>/resolve/", views.resolve, name="resolve"),
    path("audit/", views.audit, name="audit"),
    path("audit/export.csv", views.audit_csv, name="audit_csv"),
]
