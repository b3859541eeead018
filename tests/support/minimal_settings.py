"""A second host project: `ledger` and `review` installed with nothing of config/.

tests/test_reusable_apps.py runs a child process with this DJANGO_SETTINGS_MODULE. It sets
no `LEDGER_*` setting (each has its default, ledger/conf.py), no template or static
directory of its own and no admin: whatever the desk needs must ship inside `review`. The
database comes as JSON in MINIMAL_HOST_DATABASE (HOST, PORT, USER, PASSWORD, NAME), which
the parent test takes from its own connection and points at a database of its own.
"""

import json
import os

SECRET_KEY = "minimal-host-for-tests-only-0123456789abcdef0123456789abcdef"
DEBUG = False
ALLOWED_HOSTS = ["testserver"]

INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_htmx",
    "pgtrigger",
    "ledger",
    "review",
]

MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.auth.middleware.LoginRequiredMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
]

ROOT_URLCONF = "tests.support.minimal_urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        **json.loads(os.environ["MINIMAL_HOST_DATABASE"]),
    }
}

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
LOGIN_URL = "/accounts/login/"
# The desk's own page for a failed CSRF check (its template ships inside `review`).
CSRF_FAILURE_VIEW = "review.security.csrf_failure"
STATIC_URL = "static/"
USE_TZ = True
TIME_ZONE = "UTC"
