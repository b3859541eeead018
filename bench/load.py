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
- 20 agents, each a thread of this process: record the intent, submit, send, record the
  answer; an operation the reconcilers prove absent (safe_to_retry) is resent under the
  same key. Even agents write through the `ledger` API in this process; odd agents go over
  the HTTP API to the gunicorn server under test (one keep-alive connection each, one agent
  key created for the run whose secret only they hold), passing `expected_version` on every
  mark, so that both transports load the same database at once;
- 5 reviewers, each logged in over HTTP with a session, loading the queue, an operation's
  page and the audit log in turn.

Bounded: the agents stop after --seconds or --operations each, whichever comes first; the
reconcilers then get up to --drain seconds to empty the backlog. Prints throughput, page
latencies (p50/p99), the backlog, and checks afterwards: no article created twice for one
key, every operation in a known state, every operation's events a gap-free sequence of
legal transitions ending in its state (each transition evidenced exactly once), every
operation an agent saw succeed or be rejected in that state, the HTTP agents' transitions
recorded under their key's name (and nobody else's), and `verify_audit` clean. Throughput
is printed per transport, with the HTTP API's errors (problem+json, counted by status and
type; an agent never crashes on one). Exits non-zero if an invariant fails.

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
from dataclasses import dataclass
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


def start_web(port: int, static_root: Path, log, workers: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "LEDGER_DATABASE_NAME"}
    env.update(DJANGO_ENV="production", DJANGO_SECRET_KEY="load-test-" + "k3y-" * 12,
               DJANGO_ALLOWED_HOSTS="127.0.0.1", DJANGO_SECURE_SSL_REDIRECT="0",
               DATABASE_URL=database_url(), LEDGER_STATIC_ROOT=str(static_root),
               GUNICORN_BIND=f"127.0.0.1:{port}", GUNICORN_WORKERS=str(workers),
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
    """How an even agent reaches the ledger: the Python API over the ORM.

    Agents only use `record`, `send` and `close` (and read `.state` and `.idempotency_key`
    of what `record` returns), so `HttpLedger` takes the odd ones without changing
    `agent_loop`.
    """

    transport = "in process"

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

    def close(self) -> None:
        from django.db import connections

        connections.close_all()


@dataclass(frozen=True)
class Receipt:
    """What the HTTP API answered about an operation: all an HTTP agent goes on."""

    operation_id: str
    idempotency_key: str
    state: str
    version: int

    @classmethod
    def from_json(cls, data: dict) -> Receipt:
        return cls(data["operation_id"], data["idempotency_key"], data["state"],
                   data["version"])


class ApiError(Exception):
    """The HTTP API answered a problem (problem+json), or could not be reached twice."""

    def __init__(self, kind: str, detail: str, problem: dict | None = None, *,
                 retried: bool = False):
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail, self.problem, self.retried = kind, detail, problem or {}, retried


class ApiErrors:
    """The HTTP API's errors the agents met, by kind ("409 stale-version", "transport");
    shared by the HTTP agents' threads."""

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


class HttpLedger:
    """How an odd agent reaches the ledger: the HTTP API of the gunicorn server under test.

    One keep-alive connection per agent (httpx), `Authorization: Bearer` with the run's
    agent key, as a client behind a TLS-terminating proxy. Every mark carries the version
    the agent last saw (`expected_version`), so a request repeated after a transport
    failure cannot apply twice: the intent replays (200, the same operation) and a repeated
    mark gets 409 stale-version naming the state the first one reached. An API error is
    counted in `errors` and leaves the operation where the ledger has it: nothing is sent
    to the service unless `submitted` was recorded, a send that times out or is cut is
    marked outcome_unknown (never "failed"), and the agent goes on to its next operation.
    """

    transport = "http"

    def __init__(self, base_url: str, secret: str, errors: ApiErrors):
        import httpx

        self.errors = errors
        self.http = httpx.Client(base_url=base_url, timeout=30.0, headers={
            "Authorization": f"Bearer {secret}", "X-Forwarded-Proto": "https"})

    def record(self, key: str, article: dict, target: str) -> Receipt | None:
        """The operation (new, or the existing one for this key: its state says whether to
        send); None after an error, which is counted."""
        try:
            return Receipt.from_json(self._post("/api/v1/operations", {
                "operation": "articles.create", "target": target, "intent": article,
                "idempotency_key": key, "tenant": TENANT}, ok=(200, 201)))
        except ApiError as exc:
            self.errors.add(exc.kind, exc.detail)
            return None

    def send(self, op: Receipt, client, article: dict, fault: str | None) -> str:
        """Submit, call the service, record the answer; returns the state the agent knows."""
        articles = simulated()
        try:
            op = self._mark(op, "submitted", {})
        except ApiError as exc:
            self.errors.add(exc.kind, exc.detail)
            return op.state  # not submitted, so not sent
        try:
            answer = client.create(title=article["title"], body=article["body"],
                                   idempotency_key=op.idempotency_key, fault=fault)
        except articles.ArticleRejected as exc:
            outcome, body = "rejected", {"error_code": f"http_{exc.status}",
                                         "detail": str(exc)}
        except (OSError, http.client.HTTPException, articles.ServiceError) as exc:
            # Timeouts are OSErrors: the request may have landed, so the outcome is unknown.
            outcome, body = "outcome-unknown", {"error_code": type(exc).__name__,
                                                "detail": str(exc)[:500]}
        else:
            outcome, body = "succeeded", {"external_id": answer["id"]}
        try:
            op = self._mark(op, outcome, body)
        except ApiError as exc:
            # It stays submitted: the reconcilers' sweep of stale submissions takes it.
            self.errors.add(exc.kind, exc.detail)
        return op.state

    def close(self) -> None:
        self.http.close()

    def _mark(self, op: Receipt, outcome: str, body: dict) -> Receipt:
        reached = outcome.replace("-", "_")
        try:
            return Receipt.from_json(self._post(
                f"/api/v1/operations/{op.operation_id}/{outcome}",
                {**body, "expected_version": op.version}))
        except ApiError as exc:
            # Refused when sent again after a transport failure: if the first try landed
            # and only its answer was lost, the ledger is where we asked, one version on.
            if exc.retried and exc.kind.startswith("409"):
                current = Receipt.from_json(self._get(f"/api/v1/operations/{op.operation_id}"))
                if (current.state, current.version) == (reached, op.version + 1):
                    return current
            raise

    def _get(self, path: str) -> dict:
        return self._request("GET", path, None)

    def _post(self, path: str, body: dict, *, ok: tuple[int, ...] = (200,)) -> dict:
        return self._request("POST", path, body, ok=ok)

    def _request(self, method: str, path: str, body: dict | None, *,
                 ok: tuple[int, ...] = (200,)) -> dict:
        """The answer's JSON, or ApiError. A transport failure (a connection the server
        closed, a worker recycled) is counted and the request sent once more: each request
        here is safe to repeat."""
        import httpx

        retried = False
        while True:
            self.errors.requested()
            try:
                response = self.http.request(method, path, json=body)
                break
            except httpx.TransportError as exc:
                if retried:
                    raise ApiError("transport", f"{type(exc).__name__}: {exc}",
                                   retried=True) from None
                self.errors.add("transport, sent again", f"{type(exc).__name__}: {exc}")
                retried = True
        if response.status_code in ok:
            return response.json()
        problem = {}
        if response.headers.get("content-type", "").startswith("application/problem+json"):
            problem = response.json()
        kind = f"{response.status_code} {problem.get('type', 'not-a-problem').rsplit(':', 1)[-1]}"
        raise ApiError(kind, problem.get("detail") or response.text[:200], problem,
                       retried=retried)


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
            op = ledger.record(key, article, client.articles_url)
            if op is None:
                continue  # the API refused or was unreachable: counted; next operation
            state = ledger.send(op, client, article, fault)
            stats.lifecycle(time.perf_counter() - started, key, state)
            if state == State.OUTCOME_UNKNOWN:
                waiting[key] = article
            for key in list(waiting)[:3]:  # look again at a few waiting ones each round
                op = ledger.record(key, waiting[key], client.articles_url)
                if op is None:
                    continue
                if op.state == State.SAFE_TO_RETRY:
                    stats.resent()
                    stats.saw(key, ledger.send(op, client, waiting.pop(key), None))
                elif op.state in (State.SUCCEEDED, State.MANUAL_REVIEW, State.ABANDONED):
                    waiting.pop(key)
    finally:
        ledger.close()


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
                        help="agents (threads); the odd ones go over the HTTP API")
    parser.add_argument("--reviewers", type=int, default=REVIEWERS)
    parser.add_argument("--web-workers", type=int, default=WEB_WORKERS)
    parser.add_argument("--summary", type=Path, default=None,
                        help="write the summary as JSON here instead of into "
                             "bench/results/latest.json")
    args = parser.parse_args()
    if not 0 < args.seconds <= 600 or not 0 < args.operations <= 10_000:
        raise SystemExit("expected 0 < --seconds <= 600 and 0 < --operations <= 10000")
    if not (1 <= args.agents <= 50 and 0 <= args.reviewers <= 20
            and 1 <= args.web_workers <= 8 and 0 <= args.drain <= 600):
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
              f"x{args.web_workers} on :{port}, {RECONCILERS} reconcilers; up to "
              f"{args.seconds:.0f} s (logs in {workdir})", flush=True)

        stats = {transport: AgentStats(transport) for transport in ("in process", "http")}
        api_errors = ApiErrors()
        api = (f"http://127.0.0.1:{port}", secret, api_errors)
        pages = {name: Stopwatch(name) for name in ("queue", "operation", "audit")}
        page_errors: list[str] = []
        stop_reviewers = threading.Event()
        reviewers = [threading.Thread(target=reviewer_loop, args=(
            Reviewer(port, f"load-reviewer-{i}"), stop_reviewers, pages, page_errors))
            for i in range(args.reviewers)]
        ledgers = [transport_for(i, api) for i in range(args.agents)]
        started = time.monotonic()
        deadline = started + args.seconds
        agents = [threading.Thread(target=agent_loop, args=(
            i, ledger, service.url, deadline, args.operations, stats[ledger.transport]))
            for i, ledger in enumerate(ledgers)]
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
    for transport, stat in stats.items():
        n = len(stat.watch.samples)
        rows.append((f"  {transport}", f"{n} operations: {n / elapsed:.1f} operations/s"
                                       + _latencies(stat.watch)))
        rows.append((f"  {transport} outcomes when sent",
                     ", ".join(f"{s} {c}" for s, c in stat.states.most_common())
                     + f"; resent after proven absent {stat.resends}"))
    rows.append(("HTTP API errors",
                 f"{api_errors.total} in {api_errors.requests} requests"
                 + (": " + ", ".join(f"{k} {n}" for k, n in api_errors.counts.most_common())
                    + f"; e.g. {api_errors.examples}" if api_errors.total else "")))
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
    transport_rows, transport_problems = check_transports(stats, agent_key_name)
    service.stop()
    connections.close_all()
    rows += invariant_rows + transport_rows
    problems += transport_problems
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
            "lifecycle_p50_ms": stat.watch.median * 1000 if stat.watch.samples else None,
            "lifecycle_p99_ms": (stat.watch.percentile(0.99) * 1000
                                 if stat.watch.samples else None),
            "outcomes": dict(stat.states), "resent": stat.resends,
        } for transport, stat in stats.items()},
        "http_requests": api_errors.requests, "http_errors": dict(api_errors.counts),
        "page_p50_ms": all_pages.median * 1000 if all_pages.samples else None,
        "page_p99_ms": all_pages.percentile(0.99) * 1000 if all_pages.samples else None,
        "page_loads": len(all_pages.samples), "page_errors": len(page_errors),
        "backlog_at_end": backlog_at_end, "backlog_left": backlog_left,
        "invariants_hold": not problems, "problems": problems,
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


def _latencies(watch: Stopwatch) -> str:
    if not watch.samples:
        return ""
    return f"; lifecycle p50 {ms(watch.median)}, p99 {ms(watch.percentile(0.99))}"


if __name__ == "__main__":
    sys.exit(main())
