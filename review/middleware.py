"""Response headers every desk page gets, whichever view rendered it."""

from __future__ import annotations

from django.utils.cache import add_never_cache_headers

# Paths served to machines or as public files; everything else is a desk page that can
# show agents' intents, reasons and evidence.
CACHEABLE_PREFIXES = ("/static/",)


class NoStoreMiddleware:
    """`Cache-Control: no-store` (with Django's `max-age=0, no-cache, must-revalidate,
    private`) on every desk response, so that no browser or shared cache keeps a copy of an
    intent after logout. Static files keep their own long-lived caching (whitenoise)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        if not request.path.startswith(CACHEABLE_PREFIXES):
            add_never_cache_headers(response)
        return response
