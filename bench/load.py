"""Load test: the whole deployment at once on one machine, then its invariants.

    .venv/bin/python bench/load.py                     # 60 s, the README's figures
    .venv/bin/python bench/load.py --seconds 20 --operations 100

Starts, on loopback only, in a database of its own (`agent_ledger_load`, recreated each run):
- the simulated articles service, which does NOT deduplicate keys (only the ledger can
  prevent a second article) and drops 4% of responses after committing and loses 4% of
  requests before committing (the agents' sends then end in outcome_unknown);
- gunicorn with 4 uvicorn workers on config.asgi, production settings, the connection pool
  and collectstatic's files (`make serve`'s configuration, config/gunicorn.conf.py);
- 2 `manage.py reconcile` processes;
- 20 agents, each a thread of this process writing receipts through the ledger API: record
  the intent, submit, send, record the answer; an operation the reconcilers prove absent
  (safe_to_retry) is resent under the same key;
- 5 reviewers, each logged in over HTTP with a session, loading the queue, an operation's
  page and the audit log in turn.

Bounded: the agents stop after --seconds or --operations each, whichever comes first; the
reconcilers then get up to --drain seconds to empty the backlog. Prints throughput, page
latencies (p50/p99), the backlog, and checks afterwards: no article created twice for one
key, every operation in a known state, every operation's events a gap-free sequence of
legal transitions ending in its state (each transition evidenced exactly once), and
`verify_audit` clean. Exits non-zero if an invariant fails.
"""

from __future__ import annotations

import collections
import http.client
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import quote, urlencode

os.environ.setdefault("LEDGER_BENCH_DATABASE", "agent_ledger_load")
if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import BENCH_DATABASE, ROOT, Stopwatch, ms, print_table, record  # noqa: E402

# The simulated service and its reconciler: the one place this script names their module.
SIMULATED_ARTICLES = "demo.simulated.articles"

AGENTS = 20
REVIEWERS = 5
WEB_WORKERS = 4
RECONCILERS = 2
FAULTS = (("drop_response", 0.04), ("lose_request", 0.04))
TENANT = "default"
PASSWORD = "correct horse battery staple"  # tests.factories.UserFactory's


def simulated():
    import importlib

    return importlib.import_module(SIMULATED_ARTICLES)


# --- the database ----------------------------------------------------------------------------


def fresh_database() -> None:
    """Drop and recreate the load database, then django.setup() and migrate into it."""
    import psycopg
    from psycopg import sql

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    os.environ["LEDGER_DATABASE_NAME"] = BENCH_DATABASE
    from django.conf import settings

    db = settings.DATABASES["default"]
    params = {"dbname": "postgres", "user": db.get("USER") or None,
              "password": db.get("PASSWORD") or None, "host": db.get("HOST") or None,
              "port": db.get("PORT") or None}
    with psycopg.connect(**{k: v for k, v in params.items() if v}, autocommit=True) as conn:
        name = sql.Identifier(BENCH_DATABASE)
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(name))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(name))
    from bench.common import setup_django

    setup_django()


def database_url() -> str:
    from django.db import connection

    db = connection.settings_dict
    host = quote(db["HOST"] or "127.0.0.1", safe="")
    auth = db["USER"] + (f":{quote(db['PASSWORD'], safe='')}" if db.get("PASSWORD") else "")
    return f"postgres://{auth}@{host}:{db['PORT'] or 5432}/{db['NAME']}"


# --- the processes ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_web(port: int, static_root: Path, log) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "LEDGER_DATABASE_NAME"}
    env.update(DJANGO_ENV="production", DJANGO_SECRET_KEY="load-test-" + "k3y-" * 12,
               DJANGO_ALLOWED_HOSTS="127.0.0.1", DJANGO_SECURE_SSL_REDIRECT="0",
               DATABASE_URL=database_url(), LEDGER_STATIC_ROOT=str(static_root),
               GUNICORN_BIND=f"127.0.0.1:{port}", GUNICORN_WORKERS=str(WEB_WORKERS),
               GUNICORN_ACCESS_LOG="/dev/null", PYTHONUNBUFFERED="1")
    done = subprocess.run([sys.executable, "manage.py", "collectstatic", "--no-input", "-v", "0"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise SystemExit(f"expected collectstatic to succeed, found:\n{done.stderr}")
    gunicorn = Path(sys.executable).with_name("gunicorn")
    proc = subprocess.Popen([str(gunicorn), "-c", "config/gunicorn.conf.py",
                             "config.asgi:application"], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/healthz")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            time.sleep(0.3)
        if proc.poll() is not None:
            break
    stop(proc)
    raise SystemExit("expected gunicorn to answer /healthz within 90 s; see its log")


def start_reconcilers(log) -> list[subprocess.Popen]:
    env = dict(os.environ, LEDGER_DATABASE_NAME=BENCH_DATABASE,
               LEDGER_RECONCILER_MODULES=SIMULATED_ARTICLES, PYTHONUNBUFFERED="1")
    return [subprocess.Popen([sys.executable, "manage.py", "reconcile", "--interval", "0.5",
                              "--worker-name", f"load-reconcile-{i}"],
                             cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log,
                             start_new_session=True)
            for i in range(RECONCILERS)]


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


# --- agents ----------------------------------------------------------------------------------


class InProcessLedger:
    """How an agent reaches the ledger: here, the Python API over the ORM.

    Agents only use `record` and `send`, so an agent talking to the HTTP API (an object
    with the same two methods) can take half of them without changing `agent_loop`.
    """

    def record(self, key: str, article: dict, target: str):
        from ledger import receipts

        return receipts.record_intent("articles.create", target, article, tenant=TENANT,
                                      idempotency_key=key)

    def send(self, op, client, article: dict, fault: str | None) -> str:
        """Submit, call the service, record the answer; returns the state reached."""
        from ledger import receipts

        articles = simulated()
        try:
            with receipts.submit(op, rejections=(articles.ArticleRejected,)) as attempt:
                answer = client.create(title=article["title"], body=article["body"],
                                       idempotency_key=op.idempotency_key, fault=fault)
                attempt.succeeded(external_id=answer["id"])
        except (articles.ArticleRejected, OSError, http.client.HTTPException,
                articles.ServiceError):
            pass  # the receipt says rejected or outcome_unknown; nothing is resent blindly
        return attempt.op.state


def transport_for(agent_index: int):
    """Every agent in process until the HTTP API exists; then odd agents go over HTTP."""
    return InProcessLedger()


def agent_loop(index: int, service_url: str, deadline: float, limit: int, stats) -> None:
    from django.db import connections

    from ledger.states import State

    articles = simulated()
    client = articles.ArticlesClient(service_url, timeout=2.0)
    ledger = transport_for(index)
    rng = random.Random(index)
    waiting: dict[str, dict] = {}  # key -> article, for operations awaiting a verdict
    try:
        sent = 0
        while time.monotonic() < deadline and sent < limit:
            key = f"load-{index}-{sent}"
            article = {"title": f"Article {index}.{sent}", "body": f"body {rng.random()}"}
            started = time.perf_counter()
            op = ledger.record(key, article, client.articles_url)
            state = ledger.send(op, client, article, _fault(rng))
            stats.lifecycle(time.perf_counter() - started, state)
            if state == State.OUTCOME_UNKNOWN:
                waiting[key] = article
            sent += 1
            for key in list(waiting)[:3]:  # look again at a few waiting ones each round
                op = ledger.record(key, waiting[key], client.articles_url)
                if op.state == State.SAFE_TO_RETRY:
                    stats.resent()
                    ledger.send(op, client, waiting.pop(key), None)
                elif op.state in (State.SUCCEEDED, State.MANUAL_REVIEW, State.ABANDONED):
                    waiting.pop(key)
    finally:
        connections.close_all()


def _fault(rng: random.Random) -> str | None:
    roll = rng.random()
    for fault, share in FAULTS:
        if roll < share:
            return fault
        roll -= share
    return None


class AgentStats:
    def __init__(self):
        self.lock = threading.Lock()
        self.watch = Stopwatch("lifecycle")
        self.states: collections.Counter = collections.Counter()
        self.resends = 0

    def lifecycle(self, seconds: float, state: str) -> None:
        with self.lock:
            self.watch.samples.append(seconds)
            self.states[state] += 1

    def resent(self) -> None:
        with self.lock:
            self.resends += 1


# --- reviewers -------------------------------------------------------------------------------


class Reviewer:
    """A browser with a session, behind a TLS-terminating proxy (X-Forwarded-Proto)."""

    def __init__(self, port: int, username: str):
        self.port, self.username = port, username
        self.cookies: dict[str, str] = {}
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def request(self, method: str, path: str, form: dict | None = None) -> tuple[int, bytes]:
        headers = {"Host": f"127.0.0.1:{self.port}", "X-Forwarded-Proto": "https"}
        if self.cookies:
            headers["Cookie"] = "; ".join(f"{k}={v}" for k, v in self.cookies.items())
        body = None
        if form is not None:
            body = urlencode(form)
            origin = f"https://127.0.0.1:{self.port}"
            headers.update({"Content-Type": "application/x-www-form-urlencoded",
                            "Origin": origin, "Referer": origin + path})
        try:
            self.conn.request(method, path, body=body, headers=headers)
            response = self.conn.getresponse()
        except (OSError, http.client.HTTPException):  # a recycled worker closed keep-alive
            self.conn.close()
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            self.conn.request(method, path, body=body, headers=headers)
            response = self.conn.getresponse()
        content = response.read()
        for header in response.headers.get_all("Set-Cookie") or []:
            name, _, rest = header.partition("=")
            self.cookies[name.strip()] = rest.split(";", 1)[0]
        return response.status, content

    def log_in(self) -> None:
        status, page = self.request("GET", "/accounts/login/")
        token = re.search(rb'name="csrfmiddlewaretoken" value="([^"]+)"', page)
        if status != 200 or not token:
            raise SystemExit(f"expected the login page, found {status}")
        status, _ = self.request("POST", "/accounts/login/", {
            "username": self.username, "password": PASSWORD,
            "csrfmiddlewaretoken": token.group(1).decode()})
        if status != 302:
            raise SystemExit(f"expected reviewer {self.username} to log in, found {status}")


def reviewer_loop(reviewer: Reviewer, stop_at: threading.Event, pages, errors) -> None:
    reviewer.log_in()
    operation_path = None
    while not stop_at.is_set():
        for name, path in (("queue", "/"), ("operation", operation_path), ("audit", "/audit/")):
            if path is None:
                continue
            started = time.perf_counter()
            status, body = reviewer.request("GET", path)
            elapsed = time.perf_counter() - started
            if status != 200:
                errors.append(f"{name} {path}: {status}")
                continue
            pages[name].samples.append(elapsed)
            if name == "queue":
                found = re.search(rb'href="(/operations/[^"/]+/)"', body)
                operation_path = found.group(1).decode() if found else None


# --- invariants ------------------------------------------------------------------------------


def check_invariants(service) -> tuple[list[tuple[str, str]], list[str]]:
    from django.core.management import call_command
    from django.core.management.base import CommandError

    from ledger.models import Operation, OperationEvent
    from ledger.states import TRANSITIONS, State

    problems: list[str] = []
    rows: list[tuple[str, str]] = []

    per_key = collections.Counter(a["idempotency_key"] for a in service.side_effects())
    duplicates = {k: n for k, n in per_key.items() if n > 1}
    if duplicates:
        problems.append(f"keys with more than one article: {dict(list(duplicates.items())[:5])}")
    external = dict(Operation.objects.filter(state=State.SUCCEEDED)
                    .values_list("idempotency_key", "external_id"))
    by_key = {a["idempotency_key"]: a["id"] for a in service.side_effects()}
    wrong = [k for k, ext in external.items() if by_key.get(k) != ext]
    if wrong:
        problems.append(f"succeeded operations whose external id is not their article: "
                        f"{wrong[:5]}")
    rows.append(("articles created / keys", f"{sum(per_key.values())} / {len(per_key)}: "
                 f"{'no key twice' if not duplicates else f'{len(duplicates)} keys twice'}"))

    unknown = Operation.objects.exclude(state__in=State.values).count()
    if unknown:
        problems.append(f"{unknown} operations in an unknown state")

    events = collections.defaultdict(list)
    for op_id, version, from_state, to_state in (
            OperationEvent.objects.order_by("operation_id", "version")
            .values_list("operation_id", "version", "from_state", "to_state").iterator()):
        events[op_id].append((version, from_state, to_state))
    broken = 0
    for op_id, version, state in Operation.objects.values_list("id", "version", "state"):
        chain = events.get(op_id, [])
        versions = [v for v, _, _ in chain]
        legal = all(
            (i == 0 and not f) or (i > 0 and f == chain[i - 1][2] and t in TRANSITIONS[f])
            for i, (_, f, t) in enumerate(chain))
        if versions != list(range(1, version + 1)) or not legal or chain[-1][2] != state:
            broken += 1
            if broken <= 3:
                problems.append(f"operation {op_id}: events {chain} do not lead to "
                                f"{state} v{version}")
    rows.append(("operations / events", f"{len(events)} / "
                 f"{sum(len(c) for c in events.values())}: "
                 + ("every transition evidenced exactly once, all legal" if not broken
                    else f"{broken} operations with a gap, a repeat or an illegal step")))
    try:
        with open(os.devnull, "w") as quiet:
            call_command("verify_audit", actor="bench/load.py", stdout=quiet)
        rows.append(("verify_audit", "clean"))
    except CommandError as exc:
        problems.append(f"verify_audit: {exc}")
        rows.append(("verify_audit", "BROKEN"))
    return rows, problems


# --- main ------------------------------------------------------------------------------------


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="agents' time budget")
    parser.add_argument("--operations", type=int, default=1000,
                        help="operations per agent at most")
    parser.add_argument("--drain", type=float, default=60.0,
                        help="seconds the reconcilers get afterwards to empty the backlog")
    args = parser.parse_args()
    if not 0 < args.seconds <= 600 or not 0 < args.operations <= 10_000:
        raise SystemExit("expected 0 < --seconds <= 600 and 0 < --operations <= 10000")

    fresh_database()
    from django.db import connections
    from django.utils import timezone

    from ledger import health
    from ledger.models import Operation
    from ledger.states import State
    from tests.factories import UserFactory

    for i in range(REVIEWERS):
        UserFactory(username=f"load-reviewer-{i}", role="reviewer", tenants=[TENANT])
    connections.close_all()

    service = simulated().ArticlesService(dedupe_keys=False).start()
    workdir = Path(tempfile.mkdtemp(prefix="ledger-load-"))
    log = (workdir / "processes.log").open("w")
    port = free_port()
    web = reconcilers = None
    try:
        web = start_web(port, workdir / "static", log)
        reconcilers = start_reconcilers(log)
        print(f"load: {AGENTS} agents, {REVIEWERS} reviewers, gunicorn x{WEB_WORKERS} on "
              f":{port}, {RECONCILERS} reconcilers; up to {args.seconds:.0f} s "
              f"(logs in {workdir})", flush=True)

        stats = AgentStats()
        pages = {name: Stopwatch(name) for name in ("queue", "operation", "audit")}
        page_errors: list[str] = []
        stop_reviewers = threading.Event()
        reviewers = [threading.Thread(target=reviewer_loop, args=(
            Reviewer(port, f"load-reviewer-{i}"), stop_reviewers, pages, page_errors))
            for i in range(REVIEWERS)]
        started = time.monotonic()
        deadline = started + args.seconds
        agents = [threading.Thread(target=agent_loop, args=(
            i, service.url, deadline, args.operations, stats)) for i in range(AGENTS)]
        for t in reviewers + agents:
            t.start()
        for t in agents:
            t.join()
        elapsed = time.monotonic() - started
        stop_reviewers.set()
        for t in reviewers:
            t.join()

        waiting = [State.OUTCOME_UNKNOWN, State.RECONCILING]
        backlog_at_end = Operation.objects.filter(state__in=waiting).count()
        backlog_age = health.reconcile_backlog_seconds(timezone.now())
        drain_started = time.monotonic()
        while (Operation.objects.filter(state__in=waiting).count()
               and time.monotonic() - drain_started < args.drain):
            time.sleep(0.5)
        drained_in = time.monotonic() - drain_started
        backlog_left = Operation.objects.filter(state__in=waiting).count()
    finally:
        for proc in (reconcilers or []):
            stop(proc)
        if web is not None:
            stop(web)
        log.close()

    done = len(stats.watch.samples)
    all_pages = Stopwatch("all")
    for watch in pages.values():
        all_pages.samples += watch.samples
    rows = [
        ("agents", f"{done} operations in {elapsed:.1f} s: {done / elapsed:.1f} operations/s "
                   f"({3 * done / elapsed:.0f} transitions/s); lifecycle p50 "
                   f"{ms(stats.watch.median)}, p99 {ms(stats.watch.percentile(0.99))}"),
        ("outcomes when sent", ", ".join(f"{s} {n}" for s, n in stats.states.most_common())
                               + f"; resent after proven absent {stats.resends}"),
    ]
    for name, watch in [*pages.items(), ("all pages", all_pages)]:
        if watch.samples:
            rows.append((f"page {name}", f"p50 {ms(watch.median)}, p99 "
                                         f"{ms(watch.percentile(0.99))} "
                                         f"({len(watch.samples)} loads)"))
    rows.append(("page errors", str(len(page_errors)) + (f": {page_errors[:3]}"
                                                         if page_errors else "")))
    rows.append(("reconcile backlog", f"{backlog_at_end} waiting when the agents stopped "
                                      f"(head due {backlog_age:.1f} s); {backlog_left} left "
                                      f"after {drained_in:.1f} s of draining"))
    invariant_rows, problems = check_invariants(service)
    service.stop()
    rows += invariant_rows
    if page_errors:
        problems.append(f"{len(page_errors)} page loads failed")
    print_table("Load test", rows)
    record("LOAD", {
        "seconds": elapsed, "operations": done, "operations_per_s": done / elapsed,
        "lifecycle_p50_ms": stats.watch.median * 1000,
        "lifecycle_p99_ms": stats.watch.percentile(0.99) * 1000,
        "page_p50_ms": all_pages.median * 1000 if all_pages.samples else None,
        "page_p99_ms": all_pages.percentile(0.99) * 1000 if all_pages.samples else None,
        "page_loads": len(all_pages.samples), "backlog_at_end": backlog_at_end,
        "backlog_left": backlog_left, "invariants_hold": not problems,
    })
    if problems:
        print("\nINVARIANTS BROKEN:\n- " + "\n- ".join(problems))
        return 1
    print("\ninvariants hold")
    return 0


if __name__ == "__main__":
    sys.exit(main())
