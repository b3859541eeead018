"""A server's install as the runbook makes it (docs/operations.md): the project and the
Python client installed into a fresh venv with `pip install`, without the development
extras, leave no build/ folder in the checkout; the install's own `check --deploy` is clean;
its gunicorn serves the desk (templates and static files come from the wheel); and nginx
with deploy/nginx/agent-ledger.conf serves the desk over TLS in front of it.

One install and one served stack for the module. The install fetches the dependencies from
the package index: slow (minutes), each step bounded by a timeout.
"""

from __future__ import annotations

import http.client
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import TEST_LOGINS
from tests.support.processes import ROOT
from tests.support.servers import free_port

# The database is only read (by the served process); transaction=True: it sees what is committed.
pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

DEV_ONLY = ["pytest", "playwright", "langgraph", "agents", "schemathesis", "mkdocs", "honcho"]


def run(args, *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert done.returncode == 0, (
        f"expected {' '.join(map(str, args[:4]))} ... to succeed, found exit {done.returncode}:"
        f"\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A fresh venv holding `pip install .` and `pip install ./clients/python`."""
    place = tmp_path_factory.mktemp("install")
    venv = place / "venv"
    run([sys.executable, "-m", "venv", str(venv)], timeout=180)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
           "--disable-pip-version-check"]
    run([*pip, str(ROOT)], timeout=900, cwd=place)
    run([*pip, str(ROOT / "clients" / "python")], timeout=300, cwd=place)
    return place, venv


def production_env(place: Path) -> dict[str, str]:
    from tests.test_serving import database_url

    env = {k: v for k, v in os.environ.items()
           if k not in {"LEDGER_DATABASE_NAME", "DJANGO_ALLOW_ASYNC_UNSAFE", "PYTHONPATH",
                        "VIRTUAL_ENV", "DJANGO_SETTINGS_MODULE"}}
    env.update(
        DJANGO_ENV="production",
        DJANGO_SETTINGS_MODULE="config.settings",
        DJANGO_SECRET_KEY="install-test-" + "k3y-" * 14,
        DJANGO_ALLOWED_HOSTS="127.0.0.1,localhost",
        DATABASE_URL=database_url(),
        LEDGER_DATABASE_USER=TEST_LOGINS["web"],  # a login of its own, not the owner
        LEDGER_STATIC_ROOT=str(place / "static"),
        LEDGER_TRUSTED_PROXY_COUNT="1",  # nginx in front (test_nginx_...)
        GUNICORN_WORKERS="1",
        PYTHONUNBUFFERED="1",
    )
    return env


@pytest.fixture(scope="module")
def served(installed, django_db_setup):
    """gunicorn of the install, run from outside the checkout."""
    place, venv = installed
    env = production_env(place)
    port = free_port()
    env["GUNICORN_BIND"] = f"127.0.0.1:{port}"
    admin = str(venv / "bin" / "django-admin")
    run([admin, "collectstatic", "--no-input", "-v", "0"], timeout=300, cwd=place, env=env)
    site = run([str(venv / "bin" / "python"), "-c",
                "import config, os; print(os.path.dirname(config.__file__))"],
               timeout=60, cwd=place, env=env).stdout.strip()
    log = (place / "gunicorn.log").open("w")
    proc = subprocess.Popen(
        [str(venv / "bin" / "gunicorn"), "-c", f"{site}/gunicorn.conf.py",
         "config.asgi:application"],
        cwd=place, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError("expected the installed gunicorn to listen, found: "
                                         + (place / "gunicorn.log").read_text()) from None
                time.sleep(0.3)
        yield {"place": place, "venv": venv, "env": env, "port": port, "site": site,
               "log": place / "gunicorn.log"}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()


def get(port: int, path: str, *, tls: bool = False, headers: dict | None = None):
    if tls:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # the test's own self-signed certificate
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=30, context=context)
    else:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path, headers=headers or {})
    response = conn.getresponse()
    body = response.read()
    conn.close()
    return response, body


def test_an_install_without_extras_leaves_no_build_folder_checks_clean_and_serves(served):
    venv, place, env = served["venv"], served["place"], served["env"]
    found = run([str(venv / "bin" / "python"), "-c",
                 "import importlib.util, json; print(json.dumps([m for m in "
                 f"{DEV_ONLY!r} if importlib.util.find_spec(m)]))"],
                timeout=60, cwd=place).stdout.strip()
    assert found == "[]", f"expected no development extras in the install, found {found}"
    assert served["site"].startswith(str(venv)), (
        f"expected the app imported from the install, found it at {served['site']}")
    leftovers = [p for p in (ROOT / "build", ROOT / "clients" / "python" / "build")
                 if p.exists()]
    assert leftovers == [], f"expected no build/ folder in the checkout, found {leftovers}"

    # ledger.W122 names the server's agent logins limited to no tenant: on this server, the
    # test suite's own (made without --tenants: they serve every tenant's tests), so it is
    # silenced here; tests/ledger/test_rls_tenants.py holds the warning itself.
    checked = run([str(venv / "bin" / "django-admin"), "check", "--deploy"],
                  timeout=120, cwd=place, env={**env, "LEDGER_SILENCE_CHECKS": "ledger.W122"})
    assert "System check identified no issues" in checked.stdout, (
        checked.stdout + checked.stderr)

    forwarded = {"X-Forwarded-Proto": "https", "Host": "127.0.0.1"}
    response, body = get(served["port"], "/healthz", headers=forwarded)
    assert response.status == 200, body[:500]
    response, body = get(served["port"], "/accounts/login/", headers=forwarded)
    assert response.status == 200 and b'name="csrfmiddlewaretoken"' in body, body[:500]
    stylesheet = re.search(rb'href="(/static/desk/desk\.[0-9a-f]{12}\.css)"', body)
    assert stylesheet, "expected the desk's stylesheet from the wheel, collected and hashed"
    response, _ = get(served["port"], stylesheet.group(1).decode(), headers=forwarded)
    assert response.status == 200
    response, body = get(served["port"], "/no-such-page/", headers=forwarded)
    assert response.status == 404 and b"404" in body, "expected the 404 page from the wheel"


NGINX_CONF = ROOT / "deploy" / "nginx" / "agent-ledger.conf"


@pytest.mark.skipif(shutil.which("nginx") is None,
                    reason="nginx is not installed (apt-get install nginx): the TLS "
                           "configuration deploy/nginx/agent-ledger.conf is not served")
def test_nginx_serves_the_desk_over_tls_with_its_request_id(served, tmp_path):
    key, cert = tmp_path / "privkey.pem", tmp_path / "fullchain.pem"
    run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(cert)], timeout=60)
    http_port, https_port = free_port(), free_port()
    site = NGINX_CONF.read_text()
    for old, new in [("127.0.0.1:8000", f"127.0.0.1:{served['port']}"),
                     ("/etc/ssl/agent-ledger/fullchain.pem", str(cert)),
                     ("/etc/ssl/agent-ledger/privkey.pem", str(key)),
                     ("/var/log/nginx/agent-ledger.access.log", str(tmp_path / "access.log")),
                     ("listen [::]:80;", ""), ("listen [::]:443 ssl http2;", ""),
                     ("listen 80;", f"listen 127.0.0.1:{http_port};"),
                     ("listen 443 ssl http2;", f"listen 127.0.0.1:{https_port} ssl http2;"),
                     ("https://$host$request_uri", f"https://$host:{https_port}$request_uri")]:
        assert old in site, f"expected {old!r} in {NGINX_CONF}, found it not"
        site = site.replace(old, new)
    (tmp_path / "site.conf").write_text(site)
    for temp in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (tmp_path / temp).mkdir()
    as_root = "user root;" if os.geteuid() == 0 else ""  # workers may write tmp_path
    (tmp_path / "nginx.conf").write_text(f"""
{as_root}
pid {tmp_path}/nginx.pid;
error_log {tmp_path}/error.log warn;
daemon off;
worker_processes 1;
events {{ worker_connections 64; }}
http {{
    client_body_temp_path {tmp_path}/body;
    proxy_temp_path {tmp_path}/proxy;
    fastcgi_temp_path {tmp_path}/fastcgi;
    uwsgi_temp_path {tmp_path}/uwsgi;
    scgi_temp_path {tmp_path}/scgi;
    access_log off;
    include {tmp_path}/site.conf;
}}
""")
    nginx = ["nginx", "-p", str(tmp_path), "-e", str(tmp_path / "error.log"),
             "-c", str(tmp_path / "nginx.conf")]
    run([*nginx, "-t"], timeout=30)
    proxy = subprocess.Popen(nginx,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", https_port), timeout=1):
                    break
            except OSError:
                assert proxy.poll() is None and time.monotonic() < deadline, (
                    f"expected nginx to listen, found: {(tmp_path / 'error.log').read_text()}")
                time.sleep(0.2)
        response, _ = get(http_port, "/accounts/login/", headers={"Host": "localhost"})
        assert response.status == 301
        assert response.headers["Location"] == f"https://localhost:{https_port}/accounts/login/"

        response, body = get(https_port, "/accounts/login/", tls=True,
                             headers={"Host": "localhost", "X-Request-ID": "from-the-client-1"})
        assert response.status == 200 and b'name="csrfmiddlewaretoken"' in body, body[:500]
        assert "max-age=" in response.headers.get("Strict-Transport-Security", ""), (
            "expected HSTS: the app saw the request as HTTPS through the proxy")
        assert "secure" in response.headers.get("Set-Cookie", "").lower()
        request_id = response.headers["X-Request-ID"]
        assert re.fullmatch(r"[0-9a-f]{32}", request_id), (
            f"expected nginx's $request_id (not the client's), found {request_id!r}")
        response, _ = get(https_port, "/healthz", tls=True, headers={"Host": "localhost"})
        assert response.status == 200
    finally:
        proxy.send_signal(signal.SIGQUIT)
        try:
            proxy.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proxy.kill()
            proxy.wait(timeout=10)
    assert f"request_id={request_id}" in (tmp_path / "access.log").read_text(), (
        "expected the access log and the app to name the request by one id")


@pytest.mark.skipif(shutil.which("npm") is None, reason="npm not found: no TypeScript tarball")
def test_make_dist_builds_both_wheels_and_the_typescript_tarball(tmp_path):
    out = tmp_path / "dist"
    run(["make", "--no-print-directory", "dist", f"DIST={out}"], timeout=600, cwd=ROOT)
    built = sorted(re.sub(r"\d+\.\d+\.\d+", "V", p.name) for p in out.iterdir())
    assert built == ["agent-ledger-client-V.tgz", "agent_ledger-V-py3-none-any.whl",
                     "agent_ledger_client-V-py3-none-any.whl"], built
    leftovers = [p for p in (ROOT / "build", ROOT / "clients" / "python" / "build")
                 if p.exists()]
    assert leftovers == [], f"expected no build/ folder in the checkout, found {leftovers}"
