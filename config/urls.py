from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", include(("api.urls", "api-v1"), namespace="api-v1")),
    path("accounts/", include("django.contrib.auth.urls")),
    path("", include("review.urls")),
]
