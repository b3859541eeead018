"""URLs of the second host project (tests/support/minimal_settings.py): the desk and login."""

from django.urls import include, path

urlpatterns = [
    path("accounts/", include("django.contrib.auth.urls")),
    path("desk/", include("review.urls")),
]
