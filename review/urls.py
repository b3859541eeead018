from django.urls import path

from review import views

app_name = "review"

urlpatterns = [
    path("", views.queue, name="queue"),
    path("operations/<str:operation_id>/", views.operation_detail, name="operation"),
]
