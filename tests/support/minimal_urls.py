"""URLs of the second host project (tests/support/minimal_settings.py): the desk, login
and the operators' endpoints."""

from django.urls import include, path

from review import views_ops

urlpatterns = [
    path("accounts/", include("django.contrib.auth.urls")),
    path("desk/", include("review.urls")),
    path("healthz", views_ops.healthz),
    path("metrics", views_ops.metrics_view),
]
