"""config.urls (its patterns and error handlers) plus /boom-for-tests/, a desk page that
raises (tests/support/error_settings.py)."""

from django.urls import path

from config.urls import *  # noqa: F403
from config.urls import urlpatterns as project_urls


def boom(request):
    raise RuntimeError("boom for tests: an unexpected error in a view")


urlpatterns = [path("boom-for-tests/", boom), *project_urls]
