"""Settings for Agent Ledger.

Development by default. `DJANGO_ENV=production` switches to production settings, which
take every secret from the environment and refuse to start without them.
"""

import json
import os
from datetime import timedelta
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured
from django.utils.csp import CSP

from config.logs import logging_config

BASE_DIR = Path(__file__).resolve().parent.parent
DJANGO_ENV = os.environ.get("DJANGO_ENV", "development")
IS_PRODUCTION = DJANGO_ENV == "production"


def _required_env(name: str) -> str:
    value = os.environ.get(name, "")
    if not value:
        raise ImproperlyConfigured(
            f"expected the environment variable {name} to be set when DJANGO_ENV=production, "
            "found it unset or empty"
        )
    return value


if IS_PRODUCTION:
    SECRET_KEY = _required_env("DJANGO_SECRET_KEY")
    # Rotation (docs/operations.md): the previous keys, comma-separated, still accepted for
    # sessions and signed values until they expire; new ones are signed with SECRET_KEY.
    SECRET_KEY_FALLBACKS = [
        k.strip() for k in os.environ.get("DJANGO_SECRET_KEY_FALLBACKS", "").split(",")
        if k.strip()
    ]
    DEBUG = False
    ALLOWED_HOSTS = [h.strip() for h in _required_env("DJANGO_ALLOWED_HOSTS").split(",")]
else:
    SECRET_KEY = os.environ.get(
        "DJANGO_SECRET_KEY", "dev-only-insecure-key-never-used-in-production-0123456789abcdef"
    )
    DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
    ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver", "[::1]"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_htmx",
    "pgtrigger",
    "axes",
    "ledger",
    "review",
    "demo",
    # The agent API over HTTP and MCP; "ninja" serves the API docs' assets from static.
    "ninja",
    "api",
]

MIDDLEWARE = [
    # Each request's id, in its log lines and its response's X-Request-ID (config/logs.py);
    # first, so that a 500 answer carries it too.
    "config.logs.RequestIdMiddleware",
    # Each request's database work as its kind's role (the API and MCP as ledger_agent, the
    # desk as ledger_desk) when the login may become both: ledger/db_roles.py.
    "ledger.db_roles.RequestRoleMiddleware",
    "django.middleware.security.SecurityMiddleware",
    # Static files (collected by `manage.py collectstatic`) straight from the app process,
    # compressed and with far-future caching, under WSGI and ASGI alike.
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.middleware.csp.ContentSecurityPolicyMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.auth.middleware.LoginRequiredMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "review.middleware.NoStoreMiddleware",
    # Last, as django-axes requires: refuses logins of locked-out clients.
    "axes.middleware.AxesMiddleware",
]

AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]

ROOT_URLCONF = "config.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "config" / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.template.context_processors.csp",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "config.wsgi.application"
ASGI_APPLICATION = "config.asgi.application"

# PostgreSQL only: the ledger's guarantees rely on row locks, SKIP LOCKED, partial unique
# indexes and triggers. DATABASE_URL names a server; without it an embedded one is started.
# Behind a transaction-pooling PgBouncer (docs/SCALING.md) LEDGER_POOLER_URL names the
# pooler, and the process connects through it instead (LEDGER_DATABASE_NAME and
# LEDGER_DATABASE_USER still apply). Each transaction may then run on another server
# connection, so nothing of the ledger's keeps session state (the desk's role is SET LOCAL,
# the workers' locks are row locks held to their COMMIT), and what a pooler cannot keep is
# off by default behind one: prepared statements (PgBouncer before 1.21; set
# LEDGER_PREPARED_STATEMENTS=1 with 1.21's max_prepared_statements) and server-side cursors.
# Migrations and db_roles connect directly (the Makefile empties LEDGER_POOLER_URL for them).
# A URL may name several servers, libpq's multi-host form (a primary and its standby,
# docs/SCALING.md): postgres://user@host1:5432,host2:5432/db?target_session_attrs=read-write
# connects to whichever is the primary now.
POOLED = bool(os.environ.get("LEDGER_POOLER_URL"))


def _database_from_url(url: str) -> dict:
    scheme, sep, rest = url.partition("://")
    authority, slash, path = rest.partition("/")
    credentials, at, hosts = authority.rpartition("@")
    if "," not in hosts:
        return dj_database_url.parse(url, conn_max_age=0)
    pairs = [host.rpartition(":") if ":" in host else (host, ":", "5432")
             for host in hosts.split(",")]
    config = dj_database_url.parse(f"{scheme}{sep}{credentials}{at}{pairs[0][0]}{slash}{path}",
                                   conn_max_age=0)
    config["HOST"] = ",".join(host for host, _, _ in pairs)
    config["PORT"] = ",".join(port for _, _, port in pairs)
    return config


if POOLED or os.environ.get("DATABASE_URL"):
    DATABASES = {"default": _database_from_url(
        os.environ["LEDGER_POOLER_URL" if POOLED else "DATABASE_URL"])}
    if DATABASES["default"]["ENGINE"] != "django.db.backends.postgresql":
        raise ImproperlyConfigured(
            f"expected {'LEDGER_POOLER_URL' if POOLED else 'DATABASE_URL'} to name a "
            f"PostgreSQL server (postgres://...), found engine "
            f"{DATABASES['default']['ENGINE']!r}"
        )
elif IS_PRODUCTION:
    _required_env("DATABASE_URL")
else:
    from config.embedded import database_settings

    DATABASES = {"default": database_settings(BASE_DIR)}

# The ledger's hot statements (ledger/prepared.py: receipts, claims, leases) are bound on
# the server and prepared once per connection, so PostgreSQL plans them once instead of at
# every call (bench/ P1 and P3 measure it). Django's own queries keep client-side binding
# and are never prepared. Off behind a pooler (LEDGER_POOLER_URL) unless
# LEDGER_PREPARED_STATEMENTS=1; LEDGER_PREPARED_STATEMENTS=0 turns them off anywhere.
DATABASES["default"].setdefault("OPTIONS", {}).setdefault(
    "prepare_threshold",
    0 if os.environ.get("LEDGER_PREPARED_STATEMENTS", "0" if POOLED else "1") != "0" else None,
)

# Django's `.iterator()` reads through a server-side cursor (a named cursor, WITH HOLD
# outside a transaction), which a transaction-pooling PgBouncer cannot keep on one server
# connection: behind one (LEDGER_POOLER_URL) iterators fetch in chunks client-side instead
# (docs/SCALING.md); LEDGER_SERVER_SIDE_CURSORS=0/1 overrides.
DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"] = (
    os.environ.get("LEDGER_SERVER_SIDE_CURSORS", "0" if POOLED else "1") == "0"
)

# A pool of connections per process (psycopg_pool through Django's OPTIONS "pool"), on by
# default in production: a request or a worker pass borrows a connection and gives it back
# instead of opening one (3-5 ms and a server process each time). Size it per process:
# a gunicorn worker (config/workers.py) runs the API's requests side by side on max_size - 1
# threads and the desk's on one more, so that none waits for a connection; a request that
# still finds all `max_size` connections busy (LEDGER_WEB_THREADS set higher) waits up to
# LEDGER_DB_POOL_TIMEOUT, then is answered 503 database-unavailable (api/http.py), never
# a 500. `max_size` 4 also leaves room for the threads of `manage.py reconcile --workers`;
# the server then needs about (web workers + worker processes) x max_size connections
# (config/gunicorn.conf.py: 4 web workers -> 16) below its max_connections (100 by
# default), or a PgBouncer in front (docs/SCALING.md). LEDGER_DB_POOL=0/1 overrides.
if os.environ.get("LEDGER_DB_POOL", "1" if IS_PRODUCTION else "0") == "1":
    DATABASES["default"]["CONN_MAX_AGE"] = 0  # the pool keeps connections, Django must not
    DATABASES["default"]["OPTIONS"]["pool"] = {
        "min_size": int(os.environ.get("LEDGER_DB_POOL_MIN_SIZE", 1)),
        "max_size": int(os.environ.get("LEDGER_DB_POOL_MAX_SIZE", 4)),
        "timeout": float(os.environ.get("LEDGER_DB_POOL_TIMEOUT", 10)),
        "max_idle": 300,
    }

# Child processes started by the tests (crash and kill tests) point at the test database.
if os.environ.get("LEDGER_DATABASE_NAME"):
    DATABASES["default"]["NAME"] = os.environ["LEDGER_DATABASE_NAME"]
# The login of this process (docs/security.md: one login per kind of process, in the roles
# `manage.py db_roles` makes), over DATABASE_URL's or the embedded server's.
if os.environ.get("LEDGER_DATABASE_USER"):
    DATABASES["default"]["USER"] = os.environ["LEDGER_DATABASE_USER"]
    DATABASES["default"]["PASSWORD"] = os.environ.get("LEDGER_DATABASE_PASSWORD", "")

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

# The ledger's models do not know where a desk is mounted: the project says where an
# operation's page is, for the admin's "View on site" link.
def _operation_url(operation):
    from review.templatetags.desk import operation_url

    return operation_url(operation)


ABSOLUTE_URL_OVERRIDES = {"ledger.operation": _operation_url}

LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/accounts/login/"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = Path(os.environ.get("LEDGER_STATIC_ROOT", BASE_DIR / "staticfiles"))
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        # Hashed names and pre-compressed copies in production (after collectstatic);
        # plain files during development and tests, which run without collectstatic.
        "BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"
        if IS_PRODUCTION else "django.contrib.staticfiles.storage.StaticFilesStorage",
    },
}

# No inline scripts and nothing from another origin: htmx is served from django-htmx's
# static files, the desk's own from review/static/.
SECURE_CSP = {
    "default-src": [CSP.SELF],
    "script-src": [CSP.SELF, CSP.NONCE],
    "style-src": [CSP.SELF],
    "img-src": [CSP.SELF, "data:"],
    "connect-src": [CSP.SELF],
    "form-action": [CSP.SELF],
    "frame-ancestors": [CSP.NONE],
    "base-uri": [CSP.SELF],
    "object-src": [CSP.NONE],
}

X_FRAME_OPTIONS = "DENY"
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
SESSION_COOKIE_HTTPONLY = True
# A failed CSRF check shows the desk's own page (review/templates/review/403_csrf.html).
CSRF_FAILURE_VIEW = "review.security.csrf_failure"

# Login lockout (django-axes). After LEDGER_LOGIN_FAILURE_LIMIT wrong passwords for one
# username, from any address, that username is refused, even with the right password,
# until LEDGER_LOGIN_COOLOFF_MINUTES after its last attempt (attempts during the lockout
# restart the clock); so is one client address after as many failures across usernames,
# where the address is trustworthy (review.security.lockout_parameters). An attacker who
# changes address gains nothing; the price is that they can lock a reviewer out for the
# cool-off (`manage.py axes_reset_username NAME` unlocks at once). A success resets the
# count. The address is REMOTE_ADDR; behind reverse proxies set LEDGER_TRUSTED_PROXY_COUNT
# so that it is read from the proxies' own entries of X-Forwarded-For
# (review.security.client_ip; docs/security-network.md).
AXES_FAILURE_LIMIT = int(os.environ.get("LEDGER_LOGIN_FAILURE_LIMIT", 10))
AXES_COOLOFF_TIME = timedelta(minutes=int(os.environ.get("LEDGER_LOGIN_COOLOFF_MINUTES", 15)))
AXES_LOCKOUT_PARAMETERS = "review.security.lockout_parameters"
AXES_RESET_ON_SUCCESS = True
AXES_CLIENT_IP_CALLABLE = "review.security.client_ip"
AXES_LOCKOUT_CALLABLE = "review.security.locked_out"
AXES_VERBOSE = False
LEDGER_TRUSTED_PROXY_COUNT = int(os.environ.get("LEDGER_TRUSTED_PROXY_COUNT", 0))

if IS_PRODUCTION:
    SECURE_SSL_REDIRECT = os.environ.get("DJANGO_SECURE_SSL_REDIRECT", "1") == "1"
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_HSTS_SECONDS = int(os.environ.get("DJANGO_HSTS_SECONDS", "31536000"))
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = True
    CSRF_TRUSTED_ORIGINS = [
        o.strip() for o in os.environ.get("DJANGO_CSRF_TRUSTED_ORIGINS", "").split(",") if o.strip()
    ]

# Every process logs to stderr, one line a record, each with its time, level, logger and
# request id (config/logs.py), a 500's traceback included, in production as in development.
# LEDGER_LOG_FORMAT: "text" (default) or "json" (one JSON object a line, for a collector);
# LEDGER_LOG_LEVEL: the ledger's own loggers' level (INFO). gunicorn's lines use the same
# format (config/gunicorn.conf.py).
LOGGING = logging_config(level=os.environ.get("LEDGER_LOG_LEVEL", "INFO"))

# Operations endpoints (review/views_ops.py). /metrics answers only with
# `Authorization: Bearer <LEDGER_METRICS_TOKEN>` and is off (404) while it is unset.
# /healthz reports the reconcile backlog as a warning past this many seconds.
LEDGER_METRICS_TOKEN = os.environ.get("LEDGER_METRICS_TOKEN", "")
LEDGER_HEALTH_RECONCILE_BACKLOG_SECONDS = int(
    os.environ.get("LEDGER_HEALTH_RECONCILE_BACKLOG_SECONDS", 300)
)
# /healthz warns when the oldest committed event has waited longer for the sealer.
LEDGER_HEALTH_SEAL_LAG_SECONDS = float(os.environ.get("LEDGER_HEALTH_SEAL_LAG_SECONDS", 30))
# The Ed25519 key manage.py audit_export signs checkpoints and bundles with (ledger/conf.py).
LEDGER_AUDIT_SIGNING_KEY = os.environ.get("LEDGER_AUDIT_SIGNING_KEY", "")

# The ledger's settings (ledger/conf.py lists each with its default); the project sets only
# these. Each may also come from an environment variable of the same name.
if os.environ.get("LEDGER_MAX_INTENT_BYTES"):
    LEDGER_MAX_INTENT_BYTES = int(os.environ["LEDGER_MAX_INTENT_BYTES"])
if os.environ.get("LEDGER_RECONCILE_MAX_FAILURES"):
    LEDGER_RECONCILE_MAX_FAILURES = int(os.environ["LEDGER_RECONCILE_MAX_FAILURES"])
if os.environ.get("LEDGER_MAX_REQUEST_BYTES"):
    LEDGER_MAX_REQUEST_BYTES = int(os.environ["LEDGER_MAX_REQUEST_BYTES"])
if os.environ.get("LEDGER_AGENT_KEY_CACHE_SECONDS"):
    LEDGER_AGENT_KEY_CACHE_SECONDS = int(os.environ["LEDGER_AGENT_KEY_CACHE_SECONDS"])
if os.environ.get("LEDGER_FACT_MAX_FUTURE_SECONDS"):
    LEDGER_FACT_MAX_FUTURE_SECONDS = int(os.environ["LEDGER_FACT_MAX_FUTURE_SECONDS"])
if os.environ.get("LEDGER_STALE_SUBMISSION_SECONDS"):
    LEDGER_STALE_SUBMISSION_SECONDS = int(os.environ["LEDGER_STALE_SUBMISSION_SECONDS"])
if os.environ.get("LEDGER_IN_FLIGHT_SECONDS"):
    LEDGER_IN_FLIGHT_SECONDS = int(os.environ["LEDGER_IN_FLIGHT_SECONDS"])
# The checks before sending per operation kind (ledger/validation.py), as JSON, so that the
# server, its API and the MCP gateway share one rule list:
# {"payments.*": {"required": ["amount"], "ranges": {"amount": {"min": 1, "max": 50000}}}}
if os.environ.get("LEDGER_OPERATION_RULES"):
    LEDGER_OPERATION_RULES = json.loads(os.environ["LEDGER_OPERATION_RULES"])

# System checks an operator has decided to live with, comma-separated (e.g. ledger.W122 where
# one in-process agent serves every tenant): `manage.py check` counts them as silenced.
SILENCED_SYSTEM_CHECKS = [name.strip() for name in
                          os.environ.get("LEDGER_SILENCE_CHECKS", "").split(",") if name.strip()]
# The demo's reconciler (demo/simulated/articles.py) for the simulated articles service;
# a comma-separated list to name your own.
LEDGER_RECONCILER_MODULES = [
    m.strip()
    for m in os.environ.get("LEDGER_RECONCILER_MODULES", "demo.simulated.articles").split(",")
    if m.strip()
]
# MCP gateway configurations (docs/agents/gateway.md) whose read-tool reconcilers
# `manage.py reconcile` runs: a comma-separated list of TOML paths.
LEDGER_GATEWAY_CONFIGS = [
    p.strip() for p in os.environ.get("LEDGER_GATEWAY_CONFIGS", "").split(",") if p.strip()
]
if LEDGER_GATEWAY_CONFIGS:
    LEDGER_RECONCILER_MODULES.append("api.gateway.reconcilers")

# Notifications (ledger/notifications.py, `manage.py notify`). Links in messages point at
# LEDGER_DESK_URL. A webhook channel names its HMAC secret; the secrets themselves come only
# from the environment: LEDGER_WEBHOOK_SECRET_<NAME>=... makes secret name <NAME>.
LEDGER_DESK_URL = os.environ.get("LEDGER_DESK_URL", "http://127.0.0.1:8000")
_SECRET_PREFIX = "LEDGER_WEBHOOK_SECRET_"
LEDGER_WEBHOOK_SECRETS = {
    name.removeprefix(_SECRET_PREFIX): value
    for name, value in os.environ.items()
    if name.startswith(_SECRET_PREFIX) and name != _SECRET_PREFIX and value
}
# The demo's channel (demo/notifications.py) signs with a fixed, published secret: never in
# production, where only the environment provides secrets.
DEMO_WEBHOOK_SECRET_NAME = "DEMO"
if DEBUG and not IS_PRODUCTION:
    LEDGER_WEBHOOK_SECRETS.setdefault(DEMO_WEBHOOK_SECRET_NAME,
                                      "demo-webhook-secret-not-for-production")
# Webhooks to loopback and private addresses (the demo's catcher): development only, unless
# LEDGER_WEBHOOK_ALLOW_PRIVATE=1 says so.
LEDGER_WEBHOOK_ALLOW_PRIVATE = os.environ.get(
    "LEDGER_WEBHOOK_ALLOW_PRIVATE", "1" if DEBUG and not IS_PRODUCTION else "0") == "1"
# Where the demo's catcher keeps what it received (demo/notifications.py).
DEMO_CATCHER_FILE = Path(os.environ.get("LEDGER_DEMO_CATCHER_FILE",
                                        BASE_DIR / ".local" / "demo-webhook-catcher.jsonl"))
for _name in ("NOTIFY_ITEMS_PER_MESSAGE", "NOTIFY_MAX_ATTEMPTS", "NOTIFY_BACKOFF_SECONDS",
              "NOTIFY_BACKOFF_CAP_SECONDS", "NOTIFY_TIMEOUT_SECONDS",
              "NOTIFY_QUEUE_GRACE_SECONDS"):
    if os.environ.get(f"LEDGER_{_name}"):
        globals()[f"LEDGER_{_name}"] = int(os.environ[f"LEDGER_{_name}"])

# E-mail (notification channels of kind e-mail): Django's mailers. In development the
# messages are printed on the console; set DJANGO_EMAIL_BACKEND and EMAIL_* for a real
# server (smtp by default in production).
DEFAULT_FROM_EMAIL = os.environ.get("LEDGER_NOTIFY_FROM_EMAIL", "agent-ledger@localhost")
MAILERS = {
    "default": {
        "BACKEND": os.environ.get(
            "DJANGO_EMAIL_BACKEND",
            "django.core.mail.backends.smtp.EmailBackend" if IS_PRODUCTION
            else "django.core.mail.backends.console.EmailBackend"),
        "OPTIONS": {
            key: value for key, value in {
                "host": os.environ.get("EMAIL_HOST"),
                "port": int(os.environ["EMAIL_PORT"]) if os.environ.get("EMAIL_PORT") else None,
                "username": os.environ.get("EMAIL_HOST_USER"),
                "password": os.environ.get("EMAIL_HOST_PASSWORD"),
                "use_tls": os.environ.get("EMAIL_USE_TLS") == "1" or None,
                # A server that accepts and never answers must not hold the notify loop.
                "timeout": int(os.environ.get("LEDGER_NOTIFY_TIMEOUT_SECONDS") or 10),
            }.items() if value is not None
        } if os.environ.get("DJANGO_EMAIL_BACKEND", "").endswith("smtp.EmailBackend")
        or IS_PRODUCTION else {},
    },
}
