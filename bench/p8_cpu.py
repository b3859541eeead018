"""P8 CPU: what an API request costs the web server's CPU, and what an action costs the
whole machine over HTTP against in process.

Starts the server that serves the agent API as the tree's Procfile runs it (its `api:`
process if it has one, else `web:`), on loopback, against the benchmark database, and
reads CPU time from Linux's /proc: utime + stime of the server's master and workers (a
worker that exited counts through its master's cutime/cstime), of the PostgreSQL
backends the server's connections run on (told apart by their `application_name`), of
this process, and of this process's own backend. Not wall time: on a shared 2-core
machine throughput follows whatever else runs, CPU per request does not.

1. **Server CPU per request, idle**: one client (the standard library's http.client,
   one keep-alive connection) sends, in turn, the three requests of an agent's round:
   record an intent with `submit: true`, mark it succeeded, read the operation back.
2. **Under load**: the same rounds from `--clients` processes at once.
3. **An action's total CPU over HTTP / in process**: the same action through the Python
   client's decorator (`ledger_client`: the intent and its submission in one request,
   then the outcome) and through `receipts.action` in this process, interleaved in rounds.
   Over HTTP: this process + the web server + its backends; in process: this process +
   its backend. The ratio is the claim (goal: at most 2x); the action's p50 and p99 over
   HTTP and in process are printed beside it.

With `--against PATH` (another checkout of the project, e.g. a `git worktree` of main),
its server runs beside this tree's, both on the same database, and every phase alternates
between them round by round: before and after in one run. Each server's figures are
printed; the claim is this tree's.

    .venv/bin/python bench/p8_cpu.py --scale quick
    .venv/bin/python bench/p8_cpu.py --against /tmp/main-tree
"""

from __future__ import annotations

import http.client
import json
import multiprocessing
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "clients" / "python"))

from bench.common import (
    ROOT,
    database_url,
    ms,
    parse_args,
    print_table,
    quiet_server,
    record,
    setup_django,
)

# rounds x (requests' rounds of 3 per server per round); actions per side per round
SCALES = {"quick": {"rounds": 6, "idle": 60, "load": 60, "actions": 40},
          "full": {"rounds": 10, "idle": 150, "load": 150, "actions": 100}}
TICK = os.sysconf("SC_CLK_TCK")
GOAL_SERVER_MS = 1.5
GOAL_TOTAL_RATIO = 2.0


# --- CPU time from /proc ---------------------------------------------------------------------


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def cpu_of(pid: int, *, with_children: bool = False) -> float:
    """CPU seconds of process `pid` (all its threads): utime + stime, and with
    `with_children` the cutime + cstime of its children that exited and were waited for."""
    fields = _stat(pid)
    if fields is None:
        return 0.0
    ticks = int(fields[11]) + int(fields[12])
    if with_children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / TICK


def children_of(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


class CPU:
    """A snapshot of CPU seconds per process; `since(earlier)` sums what each process used
    in between (a process born in between counts from zero)."""

    def __init__(self, pids: dict[int, float]):
        self.pids = pids

    def since(self, earlier: CPU) -> float:
        return sum(now - earlier.pids.get(pid, 0.0) for pid, now in self.pids.items())


# --- the servers -----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def api_command(root: Path) -> list[str]:
    """The command of the Procfile's process that serves /api (`api:`, else `web:`), its
    leading VAR=value assignments dropped and `.venv/bin/` resolved to this interpreter's."""
    lines = dict(line.split(":", 1) for line in (root / "Procfile").read_text().splitlines()
                 if line.strip() and not line.lstrip().startswith("#") and ":" in line)
    words = shlex.split(lines.get("api", lines["web"]).strip())
    while words and "=" in words[0] and not words[0].startswith("-"):
        words.pop(0)
    bindir = Path(sys.executable).parent
    return [str(bindir / Path(w).name) if w.startswith(".venv/bin/") else w for w in words]


class Server:
    def __init__(self, name: str, root: Path, workers: int | None,
                 command: str | None = None):
        from django.db import connection

        self.name, self.root, self.port = name, root, free_port()
        self.app_name = f"bench-p8cpu-{name}-{uuid.uuid4().hex[:6]}"
        url = database_url(connection.settings_dict["NAME"], application_name=self.app_name)
        env = {k: v for k, v in os.environ.items()
               if k not in ("LEDGER_DATABASE_NAME", "GUNICORN_WORKERS")}
        self.static = tempfile.TemporaryDirectory(prefix="p8cpu-static-")
        env.update(DJANGO_ENV="production", DJANGO_SECRET_KEY="p8-cpu-" + "k3y-" * 12,
                   DJANGO_ALLOWED_HOSTS="127.0.0.1", DJANGO_SECURE_SSL_REDIRECT="0",
                   DATABASE_URL=url, LEDGER_STATIC_ROOT=self.static.name,
                   GUNICORN_BIND=f"127.0.0.1:{self.port}", GUNICORN_ACCESS_LOG="/dev/null",
                   GUNICORN_LOG_LEVEL="warning", GUNICORN_MAX_REQUESTS="0",
                   PORT=str(self.port), PYTHONUNBUFFERED="1")
        if workers:
            env["GUNICORN_WORKERS"] = str(workers)
        self.command = shlex.split(command) if command else api_command(root)
        self.log = tempfile.NamedTemporaryFile(prefix=f"p8cpu-{name}-", suffix=".log",  # noqa: SIM115
                                               delete=False)
        self.process = subprocess.Popen(self.command, cwd=root, env=env, stdout=self.log,
                                        stderr=subprocess.STDOUT, start_new_session=True)

    def wait_until_serving(self) -> None:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/api/v1/openapi.json")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                time.sleep(0.3)
            if self.process.poll() is not None:
                break
        raise SystemExit(f"expected {' '.join(self.command)} in {self.root} to answer within "
                         f"90 s; see {self.log.name}")

    def cpu(self, cursor) -> tuple[CPU, CPU]:
        """(the server's processes, its database backends)."""
        master = self.process.pid
        server = {master: cpu_of(master, with_children=True)}
        for child in children_of(master):
            server[child] = cpu_of(child)
        cursor.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s",
                       [self.app_name])
        return CPU(server), CPU({pid: cpu_of(pid) for (pid,) in cursor.fetchall()})

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        self.static.cleanup()
        self.log.close()
        os.unlink(self.log.name)


# --- the clients -----------------------------------------------------------------------------


def agent_rounds(port: int, secret: str, prefix: str, count: int) -> int:
    """`count` rounds of an agent's three requests on one keep-alive connection; returns
    the number of requests sent. Exits non-zero on an unexpected answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}

    def send(method, path, payload=None):
        conn.request(method, path, body=None if payload is None else json.dumps(payload),
                     headers=headers)
        response = conn.getresponse()
        return response.status, response.read()

    for i in range(count):
        status, body = send("POST", "/api/v1/operations", {
            "operation": "bench.cpu", "target": "https://cms.example/api",
            "intent": {"title": f"Report {prefix}-{i}", "body": "x" * 400},
            "idempotency_key": f"{prefix}-{i}", "submit": True})
        data = json.loads(body)
        status2, _ = send("POST", f"/api/v1/operations/{data['operation_id']}/succeeded",
                          {"external_id": f"ext-{prefix}-{i}",
                           "expected_version": data["version"]})
        status3, body3 = send("GET", f"/api/v1/operations/{data['operation_id']}")
        if (status, status2, status3) != (201, 200, 200):
            raise SystemExit(f"expected 201, 200, 200, found {status} {status2} {status3}: "
                             f"{body3[:300].decode(errors='replace')}")
    conn.close()
    return 3 * count


def _client_process(port, secret, prefix, count, start, results):
    start.wait()
    results.put(agent_rounds(port, secret, prefix, count))


def under_load(port: int, secret: str, prefix: str, clients: int, count: int) -> int:
    context = multiprocessing.get_context("fork")
    start, results = context.Event(), context.Queue()
    workers = [context.Process(target=_client_process,
                               args=(port, secret, f"{prefix}-{c}", count, start, results))
               for c in range(clients)]
    for worker in workers:
        worker.start()
    start.set()
    sent = sum(results.get(timeout=600) for _ in workers)
    for worker in workers:
        worker.join(timeout=60)
        if worker.exitcode != 0:
            raise SystemExit(f"expected every client process to finish, found exit "
                             f"{worker.exitcode}")
    return sent


# --- the run ---------------------------------------------------------------------------------


class Tally:
    """CPU seconds and counts of one side of one phase."""

    def __init__(self):
        self.server = self.backends = self.client = self.client_backend = 0.0
        self.requests = self.actions = 0
        self.samples: list[float] = []

    def per_request_ms(self) -> float:
        return 1000 * self.server / max(self.requests, 1)

    def total_per_action_ms(self) -> float:
        return 1000 * (self.server + self.backends + self.client + self.client_backend) / max(
            self.actions, 1)


def main() -> dict:
    args = parse_args(__doc__.splitlines()[0],
                      against={"type": Path, "default": None,
                               "help": "another checkout whose server runs beside this one"},
                      clients={"type": int, "default": 4,
                               "help": "client processes under load (default 4)"},
                      workers={"type": int, "default": None,
                               "help": "web workers (default: the server's configuration)"},
                      command={"default": None,
                               "help": "serve this tree's API with this command instead of "
                                       "its Procfile's (to measure another server)"})
    setup_django()
    from django.db import connection
    from ledger_client import Ledger

    from ledger import agent_keys, receipts
    from ledger.management.commands.agent_key import ShellOperator

    scale = SCALES[args.scale]
    run = uuid.uuid4().hex[:8]
    key_name = f"bench-p8cpu-{run}"
    _, secret = agent_keys.create(key_name, tenants=["default"], user=ShellOperator())
    quiet_server()
    servers = [Server("this tree", ROOT, args.workers, args.command)]
    if args.against is not None:
        servers.append(Server("against", args.against.resolve(), args.workers))
    agents = {}
    try:
        for server in servers:
            server.wait_until_serving()
            agents[server.name] = Ledger(f"http://127.0.0.1:{server.port}", key=secret,
                                         tenant="default")
        cursor = connection.cursor()
        cursor.execute("SELECT pg_backend_pid()")
        own_backend = cursor.fetchone()[0]

        def create(article: dict) -> dict:
            return {"id": article["title"]}

        declared = {"target": "https://cms.example/api", "key": lambda a: a["title"],
                    "external_id": lambda result: result["id"]}
        local_action = receipts.action("bench.cpu", **declared)(create)
        client_actions = {name: agent.action("bench.cpu", **declared)(create)
                          for name, agent in agents.items()}
        counter = iter(range(10**9))

        def intent() -> dict:
            return {"title": f"Report {run}-{next(counter)}", "body": "x" * 400}

        for server in servers:  # warm: plans, pools, imports, every worker's connections
            agent_rounds(server.port, secret, f"{run}-warm-{server.port}", 30)
            under_load(server.port, secret, f"{run}-warmload-{server.port}", args.clients, 5)
            for _ in range(20):
                client_actions[server.name](intent())
                local_action(intent())

        idle = {s.name: Tally() for s in servers}
        load = {s.name: Tally() for s in servers}
        action = {s.name: Tally() for s in servers}
        local = Tally()
        for r in range(scale["rounds"]):
            order = servers if r % 2 == 0 else servers[::-1]
            for server in order:
                for phase, tally in (("idle", idle), ("load", load)):
                    before = server.cpu(cursor)
                    if phase == "idle":
                        sent = agent_rounds(server.port, secret, f"{run}-{r}-{server.port}",
                                            scale["idle"])
                    else:
                        per_client = max(1, scale["load"] // args.clients)
                        sent = under_load(server.port, secret, f"{run}-{r}-{server.port}-l",
                                          args.clients, per_client)
                    after = server.cpu(cursor)
                    tally[server.name].server += after[0].since(before[0])
                    tally[server.name].backends += after[1].since(before[1])
                    tally[server.name].requests += sent
            # actions: in process and over each server, alternating who goes first
            sides = [("local", None)] + [(s.name, s) for s in servers]
            for name, server in (sides if r % 2 == 0 else sides[::-1]):
                tally = local if server is None else action[name]
                run_action = local_action if server is None else client_actions[name]
                before_client = time.process_time()
                before_backend = cpu_of(own_backend)
                before = server.cpu(cursor) if server else None
                for _ in range(scale["actions"]):
                    started = time.perf_counter()
                    run_action(intent())
                    tally.samples.append(time.perf_counter() - started)
                if server:
                    after = server.cpu(cursor)
                    tally.server += after[0].since(before[0])
                    tally.backends += after[1].since(before[1])
                tally.client += time.process_time() - before_client
                tally.client_backend += cpu_of(own_backend) - before_backend
                tally.actions += scale["actions"]
                tally.requests += 2 * scale["actions"] if server else 0
    finally:
        for agent in agents.values():
            agent.close()
        for server in servers:
            server.stop()
        agent_keys.revoke(key_name, user=ShellOperator())
        connection.close()

    def pct(samples, q):
        ordered = sorted(samples)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    this = servers[0].name
    rows = []
    figures = {}
    for server in servers:
        name = server.name
        total_http = action[name].total_per_action_ms()
        figures[name] = {
            "server_ms_per_request_idle": idle[name].per_request_ms(),
            "server_ms_per_request_load": load[name].per_request_ms(),
            "backend_ms_per_request_idle": 1000 * idle[name].backends / idle[name].requests,
            "backend_ms_per_request_load": 1000 * load[name].backends / load[name].requests,
            "action_total_cpu_ms": total_http,
            "action_client_cpu_ms": 1000 * action[name].client / action[name].actions,
            "action_server_cpu_ms": 1000 * action[name].server / action[name].actions,
            "action_backend_cpu_ms": 1000 * (action[name].backends
                                             + action[name].client_backend)
                                     / action[name].actions,
            "action_p50_ms": 1000 * statistics.median(action[name].samples),
            "action_p99_ms": 1000 * pct(action[name].samples, 0.99),
            "total_cpu_ratio": total_http / local.total_per_action_ms(),
            "command": " ".join(server.command),
        }
        f = figures[name]
        label = f"{name} ({server.root})"
        rows += [
            (f"{label}", f"{' '.join(Path(w).name if '/' in w else w for w in server.command)}"),
            ("  server CPU / request, idle", f"{ms(f['server_ms_per_request_idle'] / 1000)} "
                                             f"(+ {ms(f['backend_ms_per_request_idle'] / 1000)}"
                                             " in PostgreSQL)"),
            (f"  server CPU / request, {args.clients} clients",
             f"{ms(f['server_ms_per_request_load'] / 1000)} "
             f"(+ {ms(f['backend_ms_per_request_load'] / 1000)} in PostgreSQL)"),
            ("  action over HTTP, CPU", f"{ms(total_http / 1000)}: client "
                                        f"{ms(f['action_client_cpu_ms'] / 1000)}, server "
                                        f"{ms(f['action_server_cpu_ms'] / 1000)}, PostgreSQL "
                                        f"{ms(f['action_backend_cpu_ms'] / 1000)}"),
            ("  ratio of CPU, HTTP / in process", f"{f['total_cpu_ratio']:.2f}x"),
            ("  action over HTTP, p50 / p99", f"{ms(f['action_p50_ms'] / 1000)} / "
                                              f"{ms(f['action_p99_ms'] / 1000)}"),
        ]
    local_ms = local.total_per_action_ms()
    rows += [
        ("in process (receipts.action)", f"CPU {ms(local_ms / 1000)}: this process "
                                         f"{ms(local.client / local.actions)}, PostgreSQL "
                                         f"{ms(local.client_backend / local.actions)}"),
        ("  action in process, p50 / p99", f"{ms(statistics.median(local.samples))} / "
                                           f"{ms(pct(local.samples, 0.99))}"),
    ]
    mine = figures[this]
    summary = {
        "scale": args.scale,
        "clients": args.clients,
        "ratio": mine["total_cpu_ratio"],
        **mine,
        "in_process_cpu_ms": local_ms,
        "in_process_p50_ms": 1000 * statistics.median(local.samples),
        "in_process_p99_ms": 1000 * pct(local.samples, 0.99),
        "against": ({"root": str(args.against), **figures["against"]}
                    if args.against is not None else None),
    }
    print_table(f"P8 CPU: server CPU per API request and an action's CPU, {scale['rounds']} "
                "rounds", rows)
    for what, value, goal in (
            ("server CPU / request, idle", mine["server_ms_per_request_idle"], GOAL_SERVER_MS),
            ("server CPU / request, loaded", mine["server_ms_per_request_load"],
             GOAL_SERVER_MS),
            ("action CPU, HTTP / in process", mine["total_cpu_ratio"], GOAL_TOTAL_RATIO)):
        print(f"goal {what} <= {goal}: {value:.2f} "
              + ("met" if value <= goal else "NOT met"))
    record("P8cpu", summary)
    return summary


if __name__ == "__main__":
    main()
