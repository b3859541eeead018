"""Load test: the whole deployment at once on one machine, then its invariants.

    .venv/bin/python bench/load.py                     # 60 s, the README's figures
    .venv/bin/python bench/load.py --seconds 20 --operations 100

Starts, on loopback only, in a database of its own (`agent_ledger_load`, recreated each run):
- the simulated articles service, which does NOT deduplicate keys (only the ledger can
  prevent a second article) and drops 4% of responses after committing and loses 4% of
  requests before committing (the agents' sends then end in outcome_unknown);
- gunicorn on config.asgi as `make serve` runs it (config/gunicorn.conf.py's workers and
  uvicorn worker, production settings, the connection pool, collectstatic's files);
- 2 `manage.py reconcile` processes;
- 20 agents: record the intent, submit, send, record the answer; an operation the
  reconcilers prove absent (safe_to_retry) is resent under the same key. Even agents write
  through the `ledger` API over the ORM; odd agents go over the HTTP API to the gunicorn
  server under test (one keep-alive connection each, one agent key created for the run
  whose secret only they hold), passing `expected_version` on every mark, so that both
  transports load the same database at once. Each transport's agents are threads of a
  process of their own (neither kind waits for the other's interpreter lock, nor for this
  process's service, reviewers or checks), started together once both are ready;
- 5 reviewers, each logged in over HTTP with a session (before the agents start: a
  login's password hash is set-up, not load), loading the queue, an operation's page and
  the audit log in turn.

Bounded: the agents stop after --seconds or --operations each, whichever comes first; the
reconcilers then get up to --drain seconds to empty the backlog. Prints throughput, page
latencies (p50/p99), the backlog, and checks afterwards: no article created twice for one
key, every operation in a known state, every operation's events a gap-free sequence of
legal transitions ending in its state (each transition evidenced exactly once), every
operation an agent saw succeed or be rejected in that state, the HTTP agents' transitions
recorded under their key's name (and nobody else's), and `verify_audit` clean. Throughput
is printed per transport, with the HTTP API's errors (problem+json, counted by status and
type; an agent never crashes on one), and the CPU each transport's operations
cost: its agents' process, and for HTTP the web workers' (which also serve the
reviewers' pages; PostgreSQL's is not counted). Exits non-zero if an invariant fails.

A small run for tests: `--agents 4 --reviewers 1 --web-workers 2 --summary PATH` (the
summary as JSON at PATH instead of bench/results/latest.json). When the sealer of the
operation-event chain exists, this test should run one beside the reconcilers.
"""

from __future__ import annotations

import collections
import http.client
import json
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
from queue import Empty
from urllib.parse import quote, urlencode

os.environ.setdefault("LEDGER_BENCH_DATABASE", "agent_ledger_load")
if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import BENCH_DATABASE, ROOT, Stopwatch, ms, print_table, record  # noqa: E402

# The simulated service and its reconciler: the one place this script names their module.
SIMULATED_ARTICLES = "demo.simulated.articles"

AGENTS = 20
REVIEWERS = 5
WEB_WORKERS = None  # gunicorn.conf.py's own default, what `make serve` runs
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
              "port": db.get("PORT") or None,
              "target_session_attrs": db.get("OPTIONS", {}).get("target_session_attrs")}
    with psycopg.connect(**{k: v for k, v in params.items() if v}, autocommit=True) as conn:
        name = sql.Identifier(BENCH_DATABASE)
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(name))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(name))
    from bench.common import setup_django

    setup_django()


def database_url() -> str:
    from django.db import connection

    db = connection.settings_dict
    auth = db["USER"] + (f":{quote(db['PASSWORD'], safe='')}" if db.get("PASSWORD") else "")
    hosts = (db["HOST"] or "127.0.0.1").split(",")
    ports = str(db["PORT"] or 5432).split(",")
    netloc = ",".join(f"{quote(h, safe='')}:{p}" for h, p in zip(hosts, ports, strict=False))
    options = {k: v for k, v in db.get("OPTIONS", {}).items()
               if k in ("target_session_attrs", "connect_timeout")}
    query = f"?{urlencode(options)}" if options else ""
    return f"postgres://{auth}@{netloc}/{db['NAME']}{query}"


# --- the processes ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_web(port: int, static_root: Path, log, workers: int | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "LEDGER_DATABASE_NAME"}
    env.update(DJANGO_ENV="production", DJANGO_SECRET_KEY="load-test-" + "k3y-" * 12,
               DJANGO_ALLOWED_HOSTS="127.0.0.1", DJANGO_SECURE_SSL_REDIRECT="0",
               DATABASE_URL=database_url(), LEDGER_STATIC_ROOT=str(static_root),
               GUNICORN_BIND=f"127.0.0.1:{port}", GUNICORN_ACCESS_LOG="/dev/null",
               PYTHONUNBUFFERED="1")
    if workers is not None:
        env["GUNICORN_WORKERS"] = str(workers)
    else:
        env.pop("GUNICORN_WORKERS", None)
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


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user and system) used so far by process `pid` and its children, from
    Linux's /proc (0.0 elsewhere). A child that already exited is not counted."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = 0.0
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return 0.0
    for each in [pid, *map(int, children)]:
        try:
            fields = Path(f"/proc/{each}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


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
    """How an even agent reaches the ledger: the Python API over the ORM.

    Agents only call `run` (one lifecycle: record the intent, submit, send, record the
    answer; the state reached, or None) and `look` (an operation's state by its key), so
    `HttpLedger` takes the odd ones without changing `agent_loop`.
    """

    transport = "in process"
    errors: ApiErrors | None = None  # set by agents_process: the database errors it met

    def run(self, key: str, article: dict, client, fault: str | None) -> str | None:
        return self._riding(lambda: self._run(key, article, client, fault))

    def _riding(self, step):
        """`step()`, again with the same key while the database is away (a failover), for
        up to a minute; a receipt another try already moved is answered by its state."""
        from django.db import OperationalError, connections

        from ledger.errors import OutcomeUnknown, StaleVersion

        deadline = time.monotonic() + 60
        while True:
            try:
                return step()
            except OutcomeUnknown as exc:  # a try whose answer was lost moved it on
                return exc.operation.state if getattr(exc, "operation", None) else None
            except StaleVersion as exc:  # the sweep took over a send the failover delayed
                current = getattr(exc, "current", None)
                return current.state if current is not None else None
            except OperationalError as exc:
                if self.errors is not None:
                    self.errors.add("in process: database unavailable",
                                    f"{type(exc).__name__}: {exc}")
                connections.close_all()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def _run(self, key: str, article: dict, client, fault: str | None) -> str | None:
        from ledger import receipts

        articles = simulated()
        op = receipts.record_intent("articles.create", client.articles_url, article,
                                    tenant=TENANT, idempotency_key=key)
        try:
            with receipts.submit(op, rejections=(articles.ArticleRejected,)) as attempt:
                answer = client.create(title=article["title"], body=article["body"],
                                       idempotency_key=key, fault=fault)
                attempt.succeeded(external_id=answer["id"])
        except (articles.ArticleRejected, OSError, http.client.HTTPException,
                articles.ServiceError):
            pass  # the receipt says rejected or outcome_unknown; nothing is resent blindly
        return attempt.op.state

    def look(self, key: str, article: dict, client) -> str | None:
        from ledger.models import Operation

        return self._riding(lambda: (
            Operation.objects.filter(tenant=TENANT, operation="articles.create",
                                     idempotency_key=key)
            .values_list("state", flat=True).first()))

    def close(self) -> None:
        from django.db import connections

        connections.close_all()


class ApiErrors:
    """The HTTP API's errors the agents met, by kind ("409 stale-version", "transport"),
    and the requests they made; shared by the HTTP agents' threads."""

    def __init__(self):
        self.lock = threading.Lock()
        self.counts: collections.Counter = collections.Counter()
        self.examples: list[str] = []
        self.requests = 0

    def add(self, kind: str, detail: str) -> None:
        with self.lock:
            self.counts[kind] += 1
            if len(self.examples) < 3:
                self.examples.append(f"{kind}: {detail[:200]}")

    def requested(self) -> None:
        with self.lock:
            self.requests += 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def counting_transport(errors: ApiErrors):
    """httpx's own transport (its keep-alive pool) that counts each request and each
    transport failure in `errors`, and says it came through a TLS-terminating proxy
    (X-Forwarded-Proto), as an agent behind one would."""
    import httpx

    class Counting(httpx.HTTPTransport):
        def handle_request(self, request):
            errors.requested()
            request.headers["X-Forwarded-Proto"] = "https"
            try:
                return super().handle_request(request)
            except httpx.TransportError as exc:
                errors.add("transport", f"{type(exc).__name__}: {exc}")
                raise

    return Counting()


class HttpLedger:
    """How an odd agent reaches the ledger: `ledger_client` (clients/python), as an agent
    outside this project would, against the gunicorn server under test.

    One `ledger_client.Ledger` per agent (one httpx.Client, its keep-alive connections)
    with the run's agent key; the send is an `@ledger.action`: the intent and its
    submission in one request (`"submit": true`), the call, then its outcome with the
    version the intent answered (`expected_version`): two requests a lifecycle. The client
    never sends unless the ledger recorded the submission, marks a send that timed out or
    was cut outcome_unknown (never "failed"), and records an outcome whose answer was lost
    again until it finds it landed. A ledger error is counted in `errors` by status and
    problem type and leaves the operation where the ledger has it; the agent goes on.
    """

    transport = "http"

    def __init__(self, base_url: str, secret: str, errors: ApiErrors):
        from ledger_client import Ledger

        self.errors = errors
        self.ledger = Ledger(base_url, key=secret, tenant=TENANT, timeout=30.0,
                             transport=counting_transport(errors))
        self._actions: dict[str, object] = {}

    def run(self, key: str, article: dict, client, fault: str | None) -> str | None:
        """One lifecycle through the client; the state the agent knows it reached (None:
        the ledger refused or could not be reached before anything was sent)."""
        import ledger_client

        articles = simulated()
        try:
            self._action(client)(article["title"], article["body"], key=key, fault=fault)
            return "succeeded"
        except articles.ArticleRejected:
            return "rejected"  # the client recorded it rejected, then re-raised
        except (OSError, http.client.HTTPException, articles.ServiceError) as exc:
            if getattr(exc, "__notes__", None):  # the client could not record the outcome
                self.errors.add("outcome not recorded", exc.__notes__[-1])
                return "submitted"
            return "outcome_unknown"  # a timeout or a cut: the request may have landed
        except ledger_client.OutcomeNotRecorded as exc:
            self._count(exc)
            return "submitted"  # sent; the ledger's sweep hands it to reconciliation
        except ledger_client.LedgerError as exc:
            self._count(exc)
            return exc.operation.state if exc.operation is not None else None

    def look(self, key: str, article: dict, client) -> str | None:
        """The state of the key's operation (a read: records nothing), None after an error."""
        import ledger_client

        try:
            receipt = self._action(client).receipt(article["title"], article["body"], key=key)
        except ledger_client.LedgerError as exc:
            self._count(exc)
            return None
        return receipt.state if receipt is not None else None

    def close(self) -> None:
        self.ledger.close()

    def _action(self, client):
        """The agent's action against the service behind `client`: only title and body
        leave the process as the intent (`keep`); the key and the fault do not."""
        action = self._actions.get(client.articles_url)
        if action is None:
            articles = simulated()

            @self.ledger.action("articles.create", target=client.articles_url,
                                key=lambda *args, key, **kwargs: key, keep=["title", "body"],
                                rejections=(articles.ArticleRejected,),
                                external_id=lambda answer: answer["id"])
            def create_article(title: str, body: str, *, key: str, fault: str | None = None):
                return client.create(title=title, body=body, idempotency_key=key, fault=fault)

            action = self._actions[client.articles_url] = create_article
        return action

    def _count(self, exc) -> None:
        problem = getattr(exc, "problem", None) or {}
        slug = str(problem.get("type", "")).rsplit(":", 1)[-1] or type(exc).__name__
        status = getattr(exc, "status", None)
        self.errors.add(f"{status} {slug}" if status else slug, str(exc))


def transport_for(agent_index: int, api: tuple[str, str, ApiErrors] | None):
    """Even agents in process; odd ones over the HTTP API (`api`: its base URL, the agent
    key's secret, the shared error count), when there is one."""
    if api is not None and agent_index % 2 == 1:
        return HttpLedger(*api)
    return InProcessLedger()


def transport_of_key(key: str) -> str:
    """Which transport wrote the operation with this key (`load-<agent>-<n>`)."""
    return "http" if int(key.split("-")[1]) % 2 == 1 else "in process"


def agent_loop(index: int, ledger, service_url: str, deadline: float, limit: int,
               stats) -> None:
    from ledger.states import State

    articles = simulated()
    client = articles.ArticlesClient(service_url, timeout=2.0)
    rng = random.Random(index)
    waiting: dict[str, dict] = {}  # key -> article, for operations awaiting a verdict
    try:
        sent = 0
        while time.monotonic() < deadline and sent < limit:
            key = f"load-{index}-{sent}"
            article = {"title": f"Article {index}.{sent}", "body": f"body {rng.random()}"}
            fault = _fault(rng)
            sent += 1
            started = time.perf_counter()
            state = ledger.run(key, article, client, fault)
            if state is None:
                continue  # the API refused or was unreachable: counted; next operation
            stats.lifecycle(time.perf_counter() - started, key, state)
            if state == State.OUTCOME_UNKNOWN:
                waiting[key] = article
            for key in list(waiting)[:3]:  # look again at a few waiting ones each round
                state = ledger.look(key, waiting[key], client)
                if state == State.SAFE_TO_RETRY:
                    stats.resent()
                    stats.saw(key, ledger.run(key, waiting.pop(key), client, None))
                elif state in (State.SUCCEEDED, State.MANUAL_REVIEW, State.ABANDONED):
                    waiting.pop(key)
    finally:
        ledger.close()


def agents_process(transport: str, indices: list[int], api: tuple[str, str] | None,
                   service_url: str, seconds: float, limit: int, ready, go, results) -> None:
    """One transport's agents (`indices`), each a thread of this process (started by
    `run_agents` with multiprocessing's spawn): set up, say `ready`, wait for `go`, run
    for `seconds`, then put what they saw on `results`."""
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    os.environ["LEDGER_DATABASE_NAME"] = BENCH_DATABASE
    django.setup()
    errors = ApiErrors()
    InProcessLedger.errors = errors
    stats = AgentStats(transport)
    ledgers = [transport_for(i, (*api, errors) if api else None) for i in indices]
    ready.put(transport)
    go.wait()
    cpu_before = time.process_time()
    deadline = time.monotonic() + seconds
    agents = [threading.Thread(target=agent_loop, args=(
        i, ledger, service_url, deadline, limit, stats))
        for i, ledger in zip(indices, ledgers, strict=True)]
    for t in agents:
        t.start()
    for t in agents:
        t.join()
    results.put((transport, {**stats.as_dict(), "cpu": time.process_time() - cpu_before}, {
        "counts": dict(errors.counts), "examples": errors.examples,
        "requests": errors.requests}))


def run_agents(groups: dict[str, tuple[list[int], tuple[str, str] | None]],
               service_url: str, seconds: float, limit: int, on_start=None):
    """Each transport's agents in a process of its own, started together: (stats by
    transport, the HTTP API's errors, the seconds from the start until the last finished).
    `on_start` runs once both are ready, just before they start."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=agents_process, name=f"agents {transport}", args=(
        transport, indices, api, service_url, seconds, limit, ready, go, results))
        for transport, (indices, api) in groups.items()]
    for proc in procs:
        proc.start()

    def collect(queue, timeout: float):
        """The queue's next item, or SystemExit if an agents' process died first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                return queue.get(timeout=0.5)
            except Empty:
                dead = [f"{p.name} (exit {p.exitcode})" for p in procs
                        if p.exitcode not in (None, 0)]
                if dead:
                    raise SystemExit(f"expected the agents' processes to run, found "
                                     f"{', '.join(dead)} ended; see its traceback above") from None
        raise SystemExit(f"expected the agents' processes to answer within {timeout:.0f} s")

    try:
        for _ in procs:
            collect(ready, 120)
        if on_start is not None:
            on_start()
        started = time.monotonic()
        go.set()
        found: dict[str, AgentStats] = {}
        errors = ApiErrors()
        for _ in procs:
            transport, data, errs = collect(results, seconds + 300)
            found[transport] = AgentStats.from_dict(transport, data)
            errors.counts.update(errs["counts"])
            errors.examples += errs["examples"]
            errors.requests += errs["requests"]
        elapsed = time.monotonic() - started
        stats = {transport: found[transport] for transport in groups}
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return stats, errors, elapsed


def _fault(rng: random.Random) -> str | None:
    roll = rng.random()
    for fault, share in FAULTS:
        if roll < share:
            return fault
        roll -= share
    return None


class AgentStats:
    """One transport's agents: lifecycles, outcomes, and the last state each key was seen
    in (checked against the ledger afterwards)."""

    def __init__(self, transport: str):
        self.transport = transport
        self.lock = threading.Lock()
        self.watch = Stopwatch(transport)
        self.states: collections.Counter = collections.Counter()
        self.seen: dict[str, str] = {}
        self.resends = 0
        self.cpu = 0.0  # seconds of CPU their process used while they ran

    def as_dict(self) -> dict:
        """What the agents' process sends back to the main one."""
        return {"samples": self.watch.samples, "states": dict(self.states),
                "seen": self.seen, "resends": self.resends}

    @classmethod
    def from_dict(cls, transport: str, data: dict) -> AgentStats:
        stats = cls(transport)
        stats.watch.samples = list(data["samples"])
        stats.states.update(data["states"])
        stats.seen = dict(data["seen"])
        stats.resends = data["resends"]
        stats.cpu = data.get("cpu", 0.0)
        return stats

    def lifecycle(self, seconds: float, key: str, state: str) -> None:
        with self.lock:
            self.watch.samples.append(seconds)
            self.states[state] += 1
            self.seen[key] = state

    def saw(self, key: str, state: str) -> None:
        with self.lock:
            self.seen[key] = state

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
    """Load the queue, an operation and the audit log in turn until `stop_at` (the reviewer
    logged in beforehand: a login's password hash is not part of the measured load)."""
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
    from ledger.states import TERMINAL, TRANSITIONS, State

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
            # a terminal operation's flag or re-read schedule changes with an event from
            # its state to itself (ledger.transitions: flag_by_person, reread_by_reconciler)
            (i == 0 and not f) or (i > 0 and f == chain[i - 1][2]
                                   and (t in TRANSITIONS[f] or (t == f and f in TERMINAL)))
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


def check_transports(stats: dict[str, AgentStats],
                     agent_key_name: str) -> tuple[list[tuple[str, str]], list[str]]:
    """Each transport's operations are in the ledger as its agents last saw them (succeeded
    or rejected: terminal), and carry the right actor: the HTTP agents' transitions name
    their key's agent, the in-process agents' never do."""
    from ledger.models import Operation, OperationEvent
    from ledger.states import ActorKind, State

    problems: list[str] = []
    rows: list[tuple[str, str]] = []
    ops = {key: (op_id, state) for op_id, key, state in
           Operation.objects.values_list("id", "idempotency_key", "state").iterator()}
    actors: dict[int, set[str]] = collections.defaultdict(set)
    for op_id, actor in (OperationEvent.objects.filter(actor_kind=ActorKind.AGENT)
                         .values_list("operation_id", "actor_id").iterator()):
        actors[op_id].add(actor)
    for transport, stat in stats.items():
        keys = [key for key in ops if transport_of_key(key) == transport]
        missing = [key for key in stat.seen if key not in ops]
        disagree = [(key, seen, ops[key][1]) for key, seen in stat.seen.items()
                    if key in ops and seen in (State.SUCCEEDED, State.REJECTED)
                    and ops[key][1] != seen]
        if transport == "http":
            wrong_actor = [key for key in keys if actors[ops[key][0]] != {agent_key_name}]
            who = f"every agent transition by {agent_key_name!r}"
        else:
            wrong_actor = [key for key in keys if agent_key_name in actors[ops[key][0]]]
            who = f"none by {agent_key_name!r}"
        if stat.watch.samples and not keys:
            problems.append(f"expected the {transport} agents' operations in the ledger, "
                            f"found none")
        if missing:
            problems.append(f"{transport}: operations agents recorded, not in the ledger: "
                            f"{missing[:5]}")
        if disagree:
            problems.append(f"{transport}: (key, state the agent saw, state in the ledger) "
                            f"differ: {disagree[:5]}")
        if wrong_actor:
            problems.append(f"{transport}: expected {who}, found otherwise for "
                            f"{wrong_actor[:5]}")
        rows.append((f"operations {transport}",
                     f"{len(keys)} in the ledger, {len(stat.seen)} seen by agents: "
                     + ("all there, as seen, " + who if not (missing or disagree or wrong_actor)
                        else f"{len(missing)} missing, {len(disagree)} not as seen, "
                             f"{len(wrong_actor)} with another actor")))
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
    parser.add_argument("--agents", type=int, default=AGENTS,
                        help="agents (threads of one process per transport); the odd ones go "
                             "over the HTTP API")
    parser.add_argument("--reviewers", type=int, default=REVIEWERS)
    parser.add_argument("--web-workers", type=int, default=WEB_WORKERS,
                        help="gunicorn workers (default: config/gunicorn.conf.py's, as "
                             "`make serve` runs)")
    parser.add_argument("--summary", type=Path, default=None,
                        help="write the summary as JSON here instead of into "
                             "bench/results/latest.json")
    parser.add_argument("--kill-primary-after", type=float, default=None,
                        help="seconds after the agents start to SIGKILL the primary of the "
                             "Patroni cluster (deploy/ha/cluster.py, `make test-ha`) and "
                             "measure the failover")
    args = parser.parse_args()
    if not 0 < args.seconds <= 600 or not 0 < args.operations <= 10_000:
        raise SystemExit("expected 0 < --seconds <= 600 and 0 < --operations <= 10000")
    if not (1 <= args.agents <= 50 and 0 <= args.reviewers <= 20
            and (args.web_workers is None or 1 <= args.web_workers <= 8)
            and 0 <= args.drain <= 600):
        raise SystemExit("expected 1 <= --agents <= 50, 0 <= --reviewers <= 20, "
                         "1 <= --web-workers <= 8 and 0 <= --drain <= 600")

    fresh_database()
    from django.db import connections
    from django.utils import timezone

    from ledger import agent_keys, health
    from ledger.management.commands.agent_key import ShellOperator
    from ledger.models import Operation
    from ledger.states import State
    from tests.factories import UserFactory

    for i in range(args.reviewers):
        UserFactory(username=f"load-reviewer-{i}", role="reviewer", tenants=[TENANT])
    # One key for the HTTP agents: the database keeps its hash, only they hold the secret.
    agent_key_name = "load-http-agents"
    _, secret = agent_keys.create(agent_key_name, tenants=[TENANT], user=ShellOperator())
    connections.close_all()

    service = simulated().ArticlesService(dedupe_keys=False).start()
    workdir = Path(tempfile.mkdtemp(prefix="ledger-load-"))
    log = (workdir / "processes.log").open("w")
    port = free_port()
    web = reconcilers = None
    try:
        web = start_web(port, workdir / "static", log, args.web_workers)
        reconcilers = start_reconcilers(log)
        http_agents = args.agents // 2
        print(f"load: {args.agents} agents ({args.agents - http_agents} in process, "
              f"{http_agents} over HTTP), {args.reviewers} reviewers, gunicorn "
              f"x{args.web_workers or 'default'} on :{port}, {RECONCILERS} reconcilers; up to "
              f"{args.seconds:.0f} s (logs in {workdir})", flush=True)

        pages = {name: Stopwatch(name) for name in ("queue", "operation", "audit")}
        page_errors: list[str] = []
        stop_reviewers = threading.Event()
        logged_in = [Reviewer(port, f"load-reviewer-{i}") for i in range(args.reviewers)]
        for reviewer in logged_in:
            reviewer.log_in()
        reviewers = [threading.Thread(target=reviewer_loop, args=(
            reviewer, stop_reviewers, pages, page_errors)) for reviewer in logged_in]
        load_before = os.getloadavg()[0]
        web_cpu = []

        failover: dict = {}
        killer = threading.Thread(target=kill_primary, args=(args.kill_primary_after,
                                                              failover), daemon=True)

        def start_reviewers():
            web_cpu.append(tree_cpu_seconds(web.pid))
            for t in reviewers:
                t.start()
            if args.kill_primary_after is not None:
                killer.start()

        groups = {"in process": ([i for i in range(args.agents) if i % 2 == 0], None),
                  "http": ([i for i in range(args.agents) if i % 2 == 1],
                           (f"http://127.0.0.1:{port}", secret))}
        stats, api_errors, elapsed = run_agents(groups, service.url, args.seconds,
                                                args.operations, on_start=start_reviewers)
        web_cpu.append(tree_cpu_seconds(web.pid))
        load_after = os.getloadavg()[0]
        stop_reviewers.set()
        for t in reviewers:
            t.join()

        waiting = [State.OUTCOME_UNKNOWN, State.RECONCILING]
        if args.kill_primary_after is not None:
            killer.join(timeout=120)
            # a sender cut off by the failover: the sweep hands its submission over
            waiting.append(State.SUBMITTED)
        backlog_at_end = Operation.objects.filter(state__in=waiting).count()
        backlog_age = health.reconcile_backlog_seconds(timezone.now())
        drain_started = time.monotonic()
        while (Operation.objects.filter(state__in=waiting).count()
               and time.monotonic() - drain_started < args.drain):
            time.sleep(0.5)
        drained_in = time.monotonic() - drain_started
        backlog_left = Operation.objects.filter(state__in=waiting).count()
        left_states = dict(collections.Counter(
            Operation.objects.filter(state__in=waiting).values_list("state", flat=True)))
        unsealed = None
        final_states = dict(collections.Counter(
            Operation.objects.values_list("state", flat=True)))
        if args.kill_primary_after is not None:  # the reconcilers' sealers resumed by themselves
            from ledger.models import OperationEvent

            sealing_started = time.monotonic()
            while time.monotonic() - sealing_started < 20:
                unsealed = OperationEvent.objects.filter(chain_hash__isnull=True).count()
                if not unsealed:
                    break
                time.sleep(0.5)
    finally:
        for proc in (reconcilers or []):
            stop(proc)
        if web is not None:
            stop(web)
        log.close()

    all_agents = Stopwatch("all agents")
    for stat in stats.values():
        all_agents.samples += stat.watch.samples
    done = len(all_agents.samples)
    all_pages = Stopwatch("all")
    for watch in pages.values():
        all_pages.samples += watch.samples
    rows = [
        ("agents", f"{done} operations in {elapsed:.1f} s: {done / elapsed:.1f} operations/s "
                   f"({3 * done / elapsed:.0f} transitions/s)" + _latencies(all_agents)),
    ]
    # Agents per transport: the even ones in process, the odd ones over HTTP.
    counts = {"http": args.agents // 2, "in process": args.agents - args.agents // 2}
    per_agent = {t: len(stat.watch.samples) / elapsed / max(counts[t], 1)
                 for t, stat in stats.items()}
    ratio = per_agent["http"] / per_agent["in process"] if per_agent["in process"] else None
    for transport, stat in stats.items():
        n = len(stat.watch.samples)
        rows.append((f"  {transport}", f"{n} operations by {counts[transport]} agents: "
                                       f"{n / elapsed:.1f} operations/s, "
                                       f"{per_agent[transport]:.2f} per agent"
                                       + _latencies(stat.watch)))
        rows.append((f"  {transport} outcomes when sent",
                     ", ".join(f"{s} {c}" for s, c in stat.states.most_common())
                     + f"; resent after proven absent {stat.resends}"))
    ops = {t: len(stat.watch.samples) for t, stat in stats.items()}
    web_seconds = web_cpu[1] - web_cpu[0] if len(web_cpu) == 2 else 0.0
    cpu_per_op = {
        "in process": stats["in process"].cpu / max(ops["in process"], 1),
        "http": stats["http"].cpu / max(ops["http"], 1),
        "web": web_seconds / max(ops["http"], 1),
    }
    rows.append(("CPU per operation", (
        f"in process: {ms(cpu_per_op['in process'])} in the agents' process; "
        f"http: {ms(cpu_per_op['http'])} in the agents' process + "
        f"{ms(cpu_per_op['web'])} in the web workers ({web_seconds:.1f} s, shared with "
        f"the reviewers' pages; PostgreSQL's not counted)")))
    # For information: on shared cores throughput follows CPU per operation, which
    # bench/p8_cpu.py measures (server CPU per request; an action's CPU, HTTP / in process).
    rows.append(("per-agent ratio (information)",
                 (f"HTTP {ratio:.2f}x in process" if ratio is not None
                  else "no in-process operations")
                 + f" (load average {load_before:.1f} before, {load_after:.1f} after)"))
    rows.append(("HTTP API errors",
                 f"{api_errors.total} in {api_errors.requests} requests"
                 + (": " + ", ".join(f"{k} {n}" for k, n in api_errors.counts.most_common())
                    + f"; e.g. {api_errors.examples}" if api_errors.total else "")))
    for name, watch in [*pages.items(), ("all pages", all_pages)]:
        if watch.samples:
            rows.append((f"page {name}", f"p50 {ms(watch.median)}, p99 "
                                         f"{ms(watch.percentile(0.99))} "
                                         f"({len(watch.samples)} loads)"))
    if args.kill_primary_after is not None:
        rows.append(("failover", f"{failover.get('killed', 'nothing')} killed at "
                                 f"{args.kill_primary_after:g} s; a read-write primary again "
                                 f"after {failover.get('seconds', float('nan')):.1f} s "
                                 f"({failover.get('primary', 'none')})"))
        in_process = {k: n for k, n in api_errors.counts.items() if k.startswith("in process")}
        rows.append(("errors agents saw", ", ".join(f"{k} {n}" for k, n in
                                                    api_errors.counts.most_common()) or "none"))
        problems_extra = []
        if "seconds" not in failover:
            problems_extra.append("expected a new primary after the kill, found none")
        elif failover.get("primary") == failover.get("killed_port"):
            problems_extra.append(f"expected the standby promoted, found the killed node "
                                  f"{failover['killed']} primary again")
        rows.append(("sealer after the failover", f"{unsealed} events unsealed"))
        rows.append(("states at the end", ", ".join(f"{state} {n}" for state, n in sorted(
            final_states.items()))))
        if unsealed:
            problems_extra.append(f"expected the sealers to resume and seal every event, "
                                  f"found {unsealed} unsealed 20 s after the drain")
        if backlog_left:
            problems_extra.append(f"expected every operation in flight at the kill resolved, "
                                  f"found {backlog_left} left: {left_states}")
        status_500 = sum(n for k, n in api_errors.counts.items() if k.startswith("500"))
        if status_500:
            problems_extra.append(f"{status_500} answers 500 from the API during the failover")
    else:
        problems_extra, in_process = [], {}
    rows.append(("page errors", str(len(page_errors)) + (f": {page_errors[:3]}"
                                                         if page_errors else "")))
    rows.append(("reconcile backlog", f"{backlog_at_end} waiting when the agents stopped "
                                      f"(head due {backlog_age:.1f} s); {backlog_left} left "
                                      f"after {drained_in:.1f} s of draining"))
    invariant_rows, problems = check_invariants(service)
    transport_rows, transport_problems = check_transports(stats, agent_key_name)
    service.stop()
    connections.close_all()
    rows += invariant_rows + transport_rows
    problems += transport_problems + problems_extra
    if page_errors:
        problems.append(f"{len(page_errors)} page loads failed")
    print_table("Load test", rows)
    summary = {
        "seconds": elapsed, "agents": args.agents, "operations": done,
        "operations_per_s": done / elapsed,
        "lifecycle_p50_ms": all_agents.median * 1000 if done else None,
        "lifecycle_p99_ms": all_agents.percentile(0.99) * 1000 if done else None,
        "transports": {transport: {
            "operations": len(stat.watch.samples),
            "operations_per_s": len(stat.watch.samples) / elapsed,
            "agents": counts[transport], "operations_per_s_per_agent": per_agent[transport],
            "lifecycle_p50_ms": stat.watch.median * 1000 if stat.watch.samples else None,
            "lifecycle_p99_ms": (stat.watch.percentile(0.99) * 1000
                                 if stat.watch.samples else None),
            "outcomes": dict(stat.states), "resent": stat.resends,
        } for transport, stat in stats.items()},
        "per_agent_ratio_http_to_in_process": ratio,
        "cpu_per_operation_ms": {k: v * 1000 for k, v in cpu_per_op.items()},
        "web_cpu_seconds": web_seconds,
        "load_average": [load_before, load_after],
        "http_requests": api_errors.requests, "http_errors": dict(api_errors.counts),
        "page_p50_ms": all_pages.median * 1000 if all_pages.samples else None,
        "page_p99_ms": all_pages.percentile(0.99) * 1000 if all_pages.samples else None,
        "page_loads": len(all_pages.samples), "page_errors": len(page_errors),
        "backlog_at_end": backlog_at_end, "backlog_left": backlog_left,
        "invariants_hold": not problems, "problems": problems,
        "failover": failover if args.kill_primary_after is not None else None,
        "in_process_errors": in_process,
    }
    if args.summary is not None:
        args.summary.write_text(json.dumps(summary, indent=2, sort_keys=True))
    else:
        record("LOAD", summary)
    if problems:
        print("\nINVARIANTS BROKEN:\n- " + "\n- ".join(problems))
        return 1
    print("\ninvariants hold")
    return 0


def kill_primary(after: float, found: dict) -> None:
    """After `after` s, SIGKILL the Patroni cluster's leader (its Patroni and PostgreSQL:
    the machine lost), then connect as the application does (the multi-host URL,
    target_session_attrs=read-write) until a primary answers: `found` gets what was
    killed, the seconds until a primary wrote again and which node it is."""
    import psycopg

    sys.path.insert(0, str(ROOT / "deploy" / "ha"))
    import cluster

    time.sleep(after)
    found["killed"] = cluster.kill_leader()
    killed_at = time.monotonic()
    found["killed_port"] = f"port {cluster.PORTS[cluster.NAMES.index(found['killed'])]}"
    url = database_url()
    while time.monotonic() - killed_at < 110:
        try:
            with psycopg.connect(url, connect_timeout=1, autocommit=True) as conn:
                conn.execute("CREATE TEMP TABLE failover_probe (x int)")
                port = conn.execute("SELECT inet_server_port()").fetchone()[0]
            found["seconds"] = time.monotonic() - killed_at
            found["primary"] = f"port {port}"
            print(f"failover: {found['killed']} killed; a primary on port {port} took writes "
                  f"after {found['seconds']:.1f} s", flush=True)
            return
        except psycopg.Error:
            time.sleep(0.1)


def _latencies(watch: Stopwatch) -> str:
    if not watch.samples:
        return ""
    return f"; lifecycle p50 {ms(watch.median)}, p99 {ms(watch.percentile(0.99))}"


if __name__ == "__main__":
    sys.exit(main())
