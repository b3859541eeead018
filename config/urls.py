from django.contrib import admin
from django.urls import include, path

from review import views_ops

urlpatterns = [
    path("healthz", views_ops.healthz, name="healthz"),
    path("metrics", views_ops.metrics_view, name="metrics"),
    path("admin/", admin.site.urls),
    path("api/v1/", include(("api.urls", "api-v1"), namespace="api-v1")),
    path("accounts/", include("django.contrib.auth.urls")),
    # The demo's webhook catcher: answers 404 unless the demo secret is configured.
    path("demo/", include("demo.urls")),
    path("", include("review.urls")),
]

# Error pages that never read the database (config/errors.py).
handler403 = "config.errors.forbidden"
handler404 = "config.errors.not_found"
handler500 = "config.errors.server_error"
