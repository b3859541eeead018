"""gunicorn settings for serving the desk (`make serve`).

    gunicorn -c config/gunicorn.conf.py config.asgi:application

ASGI through uvicorn's gunicorn worker (config.workers: one that drains when it stops):
config.asgi routes the whole site (and, beside the desk, any ASGI transport mounted there)
in one process. Every value can be overridden
from the environment (GUNICORN_* below) or on the command line.
"""

import multiprocessing
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from config.logs import logging_config  # noqa: E402 (after the project is on the path)

bind = os.environ.get("GUNICORN_BIND", f"127.0.0.1:{os.environ.get('PORT', '8000')}")
# Processes, not threads: each worker runs Django's sync views one at a time on its own
# thread, so CPU-bound work scales with processes. 2 x cores + 1 is gunicorn's usual
# starting point; capped at 8 so the database's connections (workers x the pool's
# max_size, see LEDGER_DB_POOL_MAX_SIZE) stay well under max_connections.
workers = int(os.environ.get("GUNICORN_WORKERS", min(8, 2 * multiprocessing.cpu_count() + 1)))
# uvicorn's gunicorn worker, except that a worker that stops (recycled by max_requests, or
# told to) finishes its requests and closes its keep-alive connections with
# `Connection: close` instead of resetting them under a request just sent.
worker_class = "config.workers.GracefulUvicornWorker"
# A request that takes longer is a bug or a stuck database: kill the worker, log it.
timeout = int(os.environ.get("GUNICORN_TIMEOUT", 30))
graceful_timeout = int(os.environ.get("GUNICORN_GRACEFUL_TIMEOUT", 30))
keepalive = int(os.environ.get("GUNICORN_KEEPALIVE", 5))
# Recycle workers now and then so that a slow leak cannot grow without bound; the jitter
# keeps them from restarting all at once. A recycled worker drains (config/workers.py):
# no request is dropped (tests/test_serving.py recycles every ~40 requests under load).
max_requests = int(os.environ.get("GUNICORN_MAX_REQUESTS", 5000))
max_requests_jitter = int(os.environ.get("GUNICORN_MAX_REQUESTS_JITTER", 500))
# Load the application in each worker after the fork: a database pool or the embedded
# PostgreSQL's connection must never be shared between processes.
preload_app = False
# Addresses whose X-Forwarded-For / X-Forwarded-Proto the server believes: none by
# default. Believed, X-Forwarded-For replaces the client's address (REMOTE_ADDR), so that
# any client on a trusted address could choose the address the login lockout counts; a
# proxy on the same host would make every local client trusted. Behind a reverse proxy,
# either set FORWARDED_ALLOW_IPS to the proxy's own address (only the proxy connects
# here), or leave it empty and set LEDGER_TRUSTED_PROXY_COUNT (docs/security-network.md).
# Django reads X-Forwarded-Proto itself (SECURE_PROXY_SSL_HEADER), whatever this says.
forwarded_allow_ips = os.environ.get("FORWARDED_ALLOW_IPS", "")
accesslog = os.environ.get("GUNICORN_ACCESS_LOG", "-")
errorlog = "-"
loglevel = os.environ.get("GUNICORN_LOG_LEVEL", "info")
proc_name = "agent-ledger"
# gunicorn's own lines (start, workers, access) in the app's format (config/logs.py:
# time, level, logger; LEDGER_LOG_FORMAT=json for one JSON object a line), on stderr. An
# access log sent elsewhere (GUNICORN_ACCESS_LOG=path) keeps gunicorn's handler.
logconfig_dict = logging_config(extra_loggers={
    "gunicorn.error": {"level": loglevel.upper(), "handlers": ["stderr"], "propagate": False},
    **({"gunicorn.access": {"level": "INFO", "handlers": ["stderr"], "propagate": False}}
       if accesslog == "-" else {}),
})
