"""P8: what the network costs an agent: the receipt lifecycle over HTTP against in process.

N operations go through intent -> submitted -> succeeded twice: through the HTTP API
(three POSTs with an agent key on one keep-alive httpx connection, to a uvicorn process
serving `config.asgi:application`, as production does) and through the `ledger` API in
this process. Both sides interleave operation by operation against the same database;
the claim is the ratio of the median lifecycles (HTTP / in process), the ratio of the
totals beside it. Each HTTP request also authenticates its key and fetches the operation
it names (the marks: both in one statement), which the in-process agent, holding the
object, does not.

A third side sends the same three POSTs with the same client to the same uvicorn serving
an app that does nothing (`bench/p8_floor.py`): the transport's floor (client library,
loopback, uvicorn, event loop). It is printed and recorded beside the claim, with what the
API adds above it, so that a ratio can be read as transport and API apart.

A fourth side sends the same three POSTs to the same API server with the standard
library's `http.client` on one keep-alive connection: a client that costs a third of
httpx's per round trip, nearer to what a Go or TypeScript agent's client costs. Its ratio
is printed and recorded beside the claim (`lean_client_ratio`); the claim stays httpx's.

Two more sides compare what an agent writes: an action through the Python client
(`ledger_client`, clients/python: the intent and its submission in one request, then the
outcome: two round trips) against the same action through the in-process decorator
(`receipts.action`). Their ratio is recorded as `client_ratio` (goal: at most 2x).

A seventh side, when node is installed, is the same action through the TypeScript client
(clients/typescript, driven by bench/p8_ts_client.mjs one call per line; the duration is
measured in node, without the pipe): `ts_client_ratio` against the same decorator. Without
node it is skipped and says so.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import uuid

if __package__ in (None, ""):
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "clients" / "python"))

from bench.common import (
    ROOT,
    Stopwatch,
    interleave,
    ms,
    parse_args,
    print_table,
    quiet_server,
    record,
    setup_django,
)
from bench.p2_queue import reset

SCALES = {"quick": 300, "full": 2000}


def start_server(app: str = "config.asgi:application") -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "warning", "--no-access-log"],
        cwd=ROOT, env={**os.environ, "DJANGO_DEBUG": "0"},  # as served: no query log
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    return server, f"http://127.0.0.1:{port}"


class LeanClient:
    """Three POSTs' worth of an agent's HTTP client: the standard library's http.client on
    one keep-alive connection, JSON in and out, the key in every request."""

    def __init__(self, url: str, secret: str):
        host, port = url.removeprefix("http://").split(":")
        self.connection = http.client.HTTPConnection(host, int(port), timeout=30)
        self.headers = {"Authorization": f"Bearer {secret}",
                        "Content-Type": "application/json"}

    def post(self, path: str, payload: dict) -> tuple[int, bytes]:
        self.connection.request("POST", path, body=json.dumps(payload).encode(),
                                headers=self.headers)
        response = self.connection.getresponse()
        return response.status, response.read()

    def close(self) -> None:
        self.connection.close()


def wait_until_serving(client, path: str, process: subprocess.Popen) -> None:
    import httpx

    deadline = time.monotonic() + 60
    while True:
        try:
            if client.get(path).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("expected the uvicorn server to start, found it down")
        time.sleep(0.2)


def main() -> dict:
    args = parse_args(__doc__.splitlines()[0])
    setup_django()
    import httpx
    from django.db import connection

    from ledger import agent_keys, receipts
    from ledger.management.commands.agent_key import ShellOperator

    reset()
    run = uuid.uuid4().hex[:10]  # keys never collide with an earlier run's
    _, secret = agent_keys.create(f"bench-p8-{run}", tenants=["default"], user=ShellOperator())
    quiet_server()
    server, url = start_server()
    floor_server, floor_url = start_server("bench.p8_floor:application")
    client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {secret}"},
                          timeout=30)
    floor_client = httpx.Client(base_url=floor_url,
                                headers={"Authorization": f"Bearer {secret}"}, timeout=30)
    lean = LeanClient(url, secret)  # connects at its first request
    from ledger_client import Ledger

    agent = Ledger(url, key=secret, tenant="default")
    node = shutil.which("node")
    ts_agent = None
    if node:
        ts_agent = subprocess.Popen(
            [node, str(ROOT / "bench" / "p8_ts_client.mjs"), url, run], cwd=ROOT,
            env={**os.environ, "LEDGER_AGENT_KEY": secret}, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, bufsize=1)
    else:
        print("P8: node not found: the TypeScript client's side is skipped")
    ts_samples: list[float] = []
    try:
        for side, path, process in ((client, "/api/v1/openapi.json", server),
                                    (floor_client, "/", floor_server)):
            wait_until_serving(side, path, process)

        n = SCALES[args.scale]
        counter = itertools.count()

        def intent(i: int) -> dict:
            return {"title": f"Quarterly report {run}-{i}", "body": "x" * 400,
                    "tags": ["a", "b"], "headers": {"Authorization": "Bearer secret"}}

        def in_process():
            i = next(counter)
            op = receipts.record_intent("bench.http", "https://cms.example/api", intent(i),
                                        idempotency_key=f"p8-{run}-{i}", actor="bench")
            receipts.mark_submitted(op, actor="bench")
            receipts.mark_succeeded(op, external_id=f"ext-{i}", actor="bench")

        def lifecycle(post):
            """The three POSTs of one receipt through `post(path, payload)`, which returns
            the status and the body's bytes (every side's client, the same requests)."""
            i = next(counter)
            status, body = post("/api/v1/operations", {
                "operation": "bench.http", "target": "https://cms.example/api",
                "intent": intent(i), "idempotency_key": f"p8-{run}-{i}"})
            operation_id = json.loads(body)["operation_id"]
            status2, _ = post(f"/api/v1/operations/{operation_id}/submitted", {})
            status3, body3 = post(f"/api/v1/operations/{operation_id}/succeeded",
                                  {"external_id": f"ext-{i}"})
            if (status, status2, status3) != (201, 200, 200):
                raise SystemExit(f"expected 201, 200, 200, found {status} {status2} "
                                 f"{status3}: {body3[:300].decode(errors='replace')}")

        def httpx_post(side):
            def post(path, payload):
                response = side.post(path, json=payload)
                return response.status_code, response.content
            return post

        def over_http():
            lifecycle(httpx_post(client))

        def transport_only():
            lifecycle(httpx_post(floor_client))

        def over_http_lean():
            lifecycle(lean.post)

        def create(article: dict) -> dict:
            return {"id": article["title"]}

        declared = {"target": "https://cms.example/api", "key": lambda a: a["title"],
                    "external_id": lambda result: result["id"]}
        in_process_action = receipts.action("bench.action", **declared)(create)
        client_action = agent.action("bench.client", **declared)(create)

        def decorator_in_process():
            in_process_action(intent(next(counter)))

        def decorator_over_client():
            client_action(intent(next(counter)))

        ts_counter = itertools.count()

        def ts_client_action():
            ts_agent.stdin.write(f"{next(ts_counter)}\n")
            answer = ts_agent.stdout.readline()
            if not answer:
                raise SystemExit("expected the TypeScript client's driver to answer, found it "
                                 f"gone (exit {ts_agent.poll()})")
            ts_samples.append(float(answer) / 1000)

        warm_ts = []
        for _ in range(20):  # warm caches, plans and connections on every side
            if ts_agent is not None:
                ts_client_action()
                warm_ts.append(ts_samples.pop())
            in_process()
            over_http()
            transport_only()
            over_http_lean()
            decorator_in_process()
            decorator_over_client()
        local, http, floor = Stopwatch("in process"), Stopwatch("http"), Stopwatch("floor")
        lean_http = Stopwatch("http, lean client")
        action_local, action_client = Stopwatch("action"), Stopwatch("action, client")
        sides = [(local, in_process), (http, over_http), (floor, transport_only),
                 (lean_http, over_http_lean), (action_local, decorator_in_process),
                 (action_client, decorator_over_client)]
        if ts_agent is not None:
            sides.append((Stopwatch("action, TypeScript client, with the pipe"),
                          ts_client_action))
        interleave(n, sides)
    finally:
        client.close()
        agent.close()
        if ts_agent is not None:
            ts_agent.stdin.close()
            ts_agent.wait(timeout=30)
        lean.close()
        floor_client.close()
        for process in (server, floor_server):
            process.terminate()
            process.wait(timeout=30)
        agent_keys.revoke(f"bench-p8-{run}", user=ShellOperator())
        connection.close()

    summary = {
        "scale": args.scale,
        "operations": n,
        "ratio": http.median / local.median,
        "ratio_of_totals": http.total / local.total,
        "http_median_ms": http.median * 1000,
        "in_process_median_ms": local.median * 1000,
        "http_p99_ms": http.percentile(0.99) * 1000,
        # the same client and server with an app that does nothing (bench/p8_floor.py)
        "transport_median_ms": floor.median * 1000,
        "transport_ratio": floor.median / local.median,
        # the same API server and requests with the standard library's http.client
        "lean_client_median_ms": lean_http.median * 1000,
        "lean_client_ratio": lean_http.median / local.median,
        # an action: ledger_client over HTTP (two round trips) / receipts.action in process
        "client_median_ms": action_client.median * 1000,
        "decorator_median_ms": action_local.median * 1000,
        "client_ratio": action_client.median / action_local.median,
        # the same action through the TypeScript client (None without node)
        "ts_client_median_ms": statistics.median(ts_samples) * 1000 if ts_samples else None,
        "ts_client_ratio": (statistics.median(ts_samples) / action_local.median
                            if ts_samples else None),
    }
    print_table(f"P8 lifecycle over HTTP, {n} operations each", [
        ("in process (ledger API)", f"{n / local.total:8.0f} ops/s, median {ms(local.median)}"),
        ("HTTP API (3 POSTs, keep-alive)", f"{n / http.total:8.0f} ops/s, "
                                           f"median {ms(http.median)}"),
        ("ratio HTTP / in process", f"{summary['ratio']:.2f}x of the medians, "
                                    f"{summary['ratio_of_totals']:.2f}x of the totals"),
        ("floor: same 3 POSTs, empty app", f"median {ms(floor.median)}, "
                                           f"{summary['transport_ratio']:.2f}x in process"),
        ("the API above the floor", f"{ms(http.median - floor.median)} a lifecycle"),
        ("HTTP API, http.client", f"median {ms(lean_http.median)}, "
                                  f"{summary['lean_client_ratio']:.2f}x in process"),
        ("action, in process (decorator)", f"median {ms(action_local.median)}"),
        ("action, ledger_client (2 POSTs)", f"median {ms(action_client.median)}, "
                                            f"{summary['client_ratio']:.2f}x the decorator"),
        ("action, TypeScript client", (f"median {ms(statistics.median(ts_samples))}, "
                                       f"{summary['ts_client_ratio']:.2f}x the decorator")
         if ts_samples else "skipped: node not found"),
    ])
    record("P8", summary)
    return summary


if __name__ == "__main__":
    main()
