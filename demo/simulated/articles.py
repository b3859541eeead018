"""A simulated "articles" HTTP service, the client agents use, and its reconciler.

The service (`ArticlesService`) is a stdlib ThreadingHTTPServer that listens on 127.0.0.1
only, on a random port. It misbehaves on demand, per server (attributes) or per request
(the `X-Simulate-Fault` header, or `fail_next`):

- "drop_response": commit the article, then close the connection without answering;
- "lose_request": read the request, then close the connection without committing;
- "slow": commit, then wait `slow_seconds` before answering (clients time out);
- "deliver_late": the request is still in the network: the client's connection is cut at
  once, and the request lands (commits) only later, `late_seconds` after it was sent, or
  when `deliver_late()` lets it land (`late_seconds=None`, the default: tests decide the
  moment). Until it lands the service knows nothing of it, so every read says absent: the
  late copy a reconciler cannot see coming;
- eventually consistent reads (`read_lag` seconds): a read does not show articles
  committed in the last `read_lag` seconds, and says so with `consistent_as_of`;
- `key_lookup = False`: lookups by idempotency key answer 501 (an index outage), so the
  reconciler falls back to its fingerprint search;
- `dedupe_keys = False`: a resent key creates a second article (the service records the
  key but does not enforce it), so only the ledger prevents duplicates.

Endpoints: POST /articles (JSON title, body; header Idempotency-Key; 422 when the title is
empty), GET /articles/<id>, GET /articles/by-key/<key> (404 when no article has the key),
GET /articles?idempotency_key=K, GET /articles?fingerprint=F&since=ISO&limit=N (bounded:
at most N, with `truncated`), GET /articles?since=ISO&limit=N (the newest N articles
committed since, newest first: `items`). Every read carries `consistent_as_of`.

`ArticlesReconciler`, registered for "articles.create", is built from the reconciler kits
(`ledger.reconcilers`): a look-up by idempotency key, else a bounded listing matched on
title and body. It never treats a read inside the consistency window as proof of absence
(NotYet). It never talks to anything but 127.0.0.1.
"""

from __future__ import annotations

import http.client
import itertools
import json
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlencode, urlsplit

from ledger import reconcile, reconcilers
from ledger.canonical import fingerprint, redact
from ledger.models import Operation

HOST = "127.0.0.1"
# The demo's articles service (`manage.py demo_articles`, in Procfile.demo) listens on
# DEMO_ARTICLES_PORT, else on the desk's port (LEDGER_DESK_URL, from `make demo`'s PORT)
# plus this offset: 8765 beside the default 8000, and a second demo on PORT=9000 at 9765.
DEMO_ARTICLES_PORT_OFFSET = 765
FAULTS = ("drop_response", "lose_request", "slow", "deliver_late")


class ArticleRejected(Exception):
    """The service refused the request (a 4xx): it created nothing."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status} {message}")
        self.status = status


class ServiceError(Exception):
    """The service answered 5xx or something unreadable: the outcome is not known."""


def content_fingerprint(title: Any, body: Any) -> str:
    """What the service and the reconciler both compute from an article's content."""
    return fingerprint(redact({"title": title, "body": body}))


def _iso(moment: datetime) -> str:
    return moment.isoformat()


# --- the service -----------------------------------------------------------------------------


class ArticlesService:
    """The simulated service; `with ArticlesService() as service:` starts and stops it."""

    def __init__(self, *, read_lag: float = 0.0, slow_seconds: float = 2.0,
                 fault: str | None = None, dedupe_keys: bool = True, key_lookup: bool = True,
                 late_seconds: float | None = None,
                 clock: Callable[[], datetime] | None = None, port: int = 0,
                 articles: Iterable[dict[str, Any]] = ()):
        if fault is not None and fault not in FAULTS:
            raise ValueError(f"expected fault one of {FAULTS} or None, found {fault!r}")
        self.read_lag = read_lag
        self.slow_seconds = slow_seconds
        self.fault = fault
        self.dedupe_keys = dedupe_keys
        self.key_lookup = key_lookup
        self.late_seconds = late_seconds
        # Where the service's times come from: the real clock, or the ledger's while the
        # demo replays its history in the past (demo.clock), so both tell one time.
        self.clock = clock or (lambda: datetime.now(UTC))
        self.port = port  # 0: any free port (tests); `manage.py demo_articles` fixes one
        self._late: list[tuple[dict[str, Any], str]] = []
        self._timers: list[threading.Timer] = []
        # What it committed before (`side_effects()` of an earlier process: the demo's
        # service starts with what the seed's agents created on it).
        self._articles: list[dict[str, Any]] = [dict(a) for a in articles]
        self._queued_faults: deque[str] = deque()
        self._in_flight: dict[int, datetime] = {}
        self._tickets = itertools.count(1)
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._connections: set[socket.socket] = set()

    # life cycle
    def start(self) -> ArticlesService:
        self._server = ThreadingHTTPServer((HOST, self.port), _handler_for(self))
        self._server.daemon_threads = True
        self._server.block_on_close = False
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="articles-service", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening and drop every open connection, as a stopped service would (a
        client's kept-alive connection must not reach a handler that outlived the server)."""
        for timer in self._timers:
            timer.cancel()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self._lock:
            open_connections, self._connections = list(self._connections), set()
        for conn in open_connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by the client

    def __enter__(self) -> ArticlesService:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def articles_url(self) -> str:
        return f"{self.url}/articles"

    # what tests and the demo inspect
    def fail_next(self, fault: str, times: int = 1) -> None:
        """The next `times` POSTs misbehave with `fault`."""
        if fault not in FAULTS:
            raise ValueError(f"expected fault one of {FAULTS}, found {fault!r}")
        with self._lock:
            self._queued_faults.extend([fault] * times)

    def deliver_late(self) -> list[dict[str, Any]]:
        """Let every request still held by "deliver_late" land now, in the order they were
        sent; returns what they created (or found, for a deduplicated key)."""
        with self._lock:
            late, self._late = self._late, []
        return [self._create(payload, key)[1] for payload, key in late]

    def late_requests(self) -> int:
        """How many requests are still in the network."""
        with self._lock:
            return len(self._late)

    def _send_late(self, payload: dict[str, Any], key: str) -> None:
        request = (payload, key)
        with self._lock:
            self._late.append(request)
        if self.late_seconds is not None:
            timer = threading.Timer(self.late_seconds, self._land, [request])
            timer.daemon = True
            self._timers.append(timer)
            timer.start()

    def _land(self, request: tuple[dict[str, Any], str]) -> None:
        with self._lock:
            if not any(held is request for held in self._late):
                return  # deliver_late() let it land already
            self._late = [held for held in self._late if held is not request]
        self._create(*request)

    def side_effects(self) -> list[dict[str, Any]]:
        """Every article ever committed, visible to reads or not (the ground truth)."""
        with self._lock:
            return [dict(a) for a in self._articles]

    # behaviour
    def _next_fault(self, requested: str | None) -> str | None:
        with self._lock:
            if requested:
                return requested
            if self._queued_faults:
                return self._queued_faults.popleft()
        return self.fault

    def _create(self, payload: dict[str, Any], key: str) -> tuple[int, dict[str, Any]]:
        title = payload.get("title")
        if not isinstance(title, str) or not title.strip():
            return 422, {"error": "title must not be empty"}
        body = payload.get("body", "")
        with self._lock:
            if key and self.dedupe_keys:
                for article in self._articles:
                    if article["idempotency_key"] == key:
                        return 200, dict(article)
            article = {
                "id": f"art-{len(self._articles) + 1:05d}",
                "title": title,
                "body": body,
                "idempotency_key": key,
                "fingerprint": content_fingerprint(title, body),
                "committed_at": _iso(self.clock()),
            }
            self._articles.append(article)
            return 201, dict(article)

    def _horizon(self) -> datetime:
        """Reads reflect every write committed, and every request started, before this."""
        now = self.clock()
        horizon = now - timedelta(seconds=self.read_lag)
        with self._lock:
            if self._in_flight:
                horizon = min(horizon, min(self._in_flight.values()))
        return horizon

    def _visible(self) -> tuple[list[dict[str, Any]], datetime]:
        cutoff = self.clock() - timedelta(seconds=self.read_lag)
        horizon = self._horizon()
        with self._lock:
            shown = [dict(a) for a in self._articles
                     if datetime.fromisoformat(a["committed_at"]) <= cutoff]
        return shown, horizon

    def _enter(self) -> int:
        with self._lock:
            ticket = next(self._tickets)
            self._in_flight[ticket] = self.clock()
            return ticket

    def _leave(self, ticket: int) -> None:
        with self._lock:
            self._in_flight.pop(ticket, None)


def _handler_for(service: ArticlesService):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self):
            super().setup()
            with service._lock:
                service._connections.add(self.connection)

        def finish(self):
            with service._lock:
                service._connections.discard(self.connection)
            super().finish()

        def log_message(self, format, *args):  # quiet: tests and the demo print their own
            pass

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True  # the client gave up waiting (a slow answer)

        def _hang_up(self) -> None:
            self.close_connection = True

        def do_POST(self):
            ticket = service._enter()
            try:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                fault = service._next_fault(self.headers.get("X-Simulate-Fault"))
                if fault == "lose_request":
                    return self._hang_up()
                if urlsplit(self.path).path != "/articles":
                    return self._send(404, {"error": "no such endpoint"})
                try:
                    payload = json.loads(raw or b"{}")
                except ValueError:
                    return self._send(400, {"error": "expected a JSON body"})
                if not isinstance(payload, dict):
                    return self._send(400, {"error": "expected a JSON object"})
                if fault == "deliver_late":
                    service._send_late(payload, self.headers.get("Idempotency-Key", ""))
                    return self._hang_up()
                status, answer = service._create(payload, self.headers.get("Idempotency-Key", ""))
            finally:
                service._leave(ticket)
            if status < 300 and fault == "drop_response":
                return self._hang_up()
            if status < 300 and fault == "slow":
                time.sleep(service.slow_seconds)
            self._send(status, answer)

        def do_GET(self):
            parts = urlsplit(self.path)
            params = {k: v[-1] for k, v in parse_qs(parts.query).items()}
            shown, horizon = service._visible()
            if parts.path.startswith("/articles/by-key/"):
                return self._by_key(shown, horizon, unquote(parts.path.removeprefix(
                    "/articles/by-key/")))
            if parts.path.startswith("/articles/"):
                wanted = parts.path.removeprefix("/articles/")
                for article in shown:
                    if article["id"] == wanted:
                        return self._send(200, {"article": article,
                                                "consistent_as_of": _iso(horizon)})
                return self._send(404, {"error": f"no article {wanted}",
                                        "consistent_as_of": _iso(horizon)})
            if parts.path != "/articles":
                return self._send(404, {"error": "no such endpoint"})
            if "idempotency_key" in params:
                if not service.key_lookup:
                    return self._send(501, {"error": "lookup by idempotency key unavailable"})
                matches = [a for a in shown if a["idempotency_key"] == params["idempotency_key"]]
                return self._send(200, {"matches": matches, "consistent_as_of": _iso(horizon)})
            if "fingerprint" in params:
                return self._search(shown, horizon, params)
            if "limit" in params:
                return self._list(shown, horizon, params)
            return self._send(400, {"error": "expected idempotency_key, fingerprint or limit"})

        def _by_key(self, shown, horizon, key):
            if not service.key_lookup:
                return self._send(501, {"error": "lookup by idempotency key unavailable"})
            for article in shown:
                if key and article["idempotency_key"] == key:
                    return self._send(200, {"article": article,
                                            "consistent_as_of": _iso(horizon)})
            return self._send(404, {"error": f"no article with key {key}",
                                    "consistent_as_of": _iso(horizon)})

        def _list(self, shown, horizon, params):
            try:
                limit = max(1, min(int(params["limit"]), 100))
                since = datetime.fromisoformat(params.get("since") or "1970-01-01T00:00:00+00:00")
            except ValueError:
                return self._send(400, {"error": "expected an integer limit and an ISO since"})
            recent = [a for a in reversed(shown)
                      if datetime.fromisoformat(a["committed_at"]) >= since]
            self._send(200, {"items": recent[:limit], "consistent_as_of": _iso(horizon)})

        def _search(self, shown, horizon, params):
            try:
                limit = max(1, min(int(params.get("limit", "20")), 100))
                since = datetime.fromisoformat(params.get("since") or "1970-01-01T00:00:00+00:00")
            except ValueError:
                return self._send(400, {"error": "expected an integer limit and an ISO since"})
            matches = [a for a in shown if a["fingerprint"] == params["fingerprint"]
                       and datetime.fromisoformat(a["committed_at"]) >= since]
            self._send(200, {"matches": matches[:limit], "truncated": len(matches) > limit,
                             "consistent_as_of": _iso(horizon)})

    return Handler


# --- the client agents use -------------------------------------------------------------------


class ArticlesClient:
    """A small HTTP client for the service. Refuses any host but 127.0.0.1.

    `create` raises ArticleRejected for a 4xx (nothing was created) and lets transport
    errors (timeouts, dropped connections: OSError, http.client.HTTPException) through:
    after those the outcome is unknown.
    """

    def __init__(self, base_url: str, *, timeout: float = 5.0):
        parts = urlsplit(base_url)
        if parts.scheme != "http" or parts.hostname != HOST or parts.port is None:
            raise ValueError(
                f"expected the simulated service at http://{HOST}:<port>, found {base_url!r}"
            )
        self.host, self.port, self.timeout = parts.hostname, parts.port, timeout

    @property
    def articles_url(self) -> str:
        return f"http://{self.host}:{self.port}/articles"

    def _request(self, method: str, path: str, body: bytes | None = None,
                 headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        connection = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            connection.request(method, path, body=body, headers=headers or {})
            response = connection.getresponse()
            data = response.read()
        finally:
            connection.close()
        try:
            return response.status, json.loads(data or b"{}")
        except ValueError:
            raise ServiceError(f"expected JSON from the service, found {data[:100]!r}") from None

    def create(self, *, title: str, body: str = "", idempotency_key: str = "",
               fault: str | None = None) -> dict[str, Any]:
        headers = {"Content-Type": "application/json", "Idempotency-Key": idempotency_key}
        if fault:
            headers["X-Simulate-Fault"] = fault
        status, answer = self._request(
            "POST", "/articles", json.dumps({"title": title, "body": body}).encode(), headers
        )
        if 400 <= status < 500:
            raise ArticleRejected(status, answer.get("error", ""))
        if status >= 500:
            raise ServiceError(f"{status} {answer.get('error', '')}")
        return answer

    def get(self, article_id: str) -> tuple[int, dict[str, Any]]:
        return self._request("GET", f"/articles/{article_id}")

    def find_by_key(self, key: str) -> tuple[int, dict[str, Any]]:
        return self._request("GET", "/articles?" + urlencode({"idempotency_key": key}))

    def search(self, fingerprint: str, *, since: datetime, limit: int) -> tuple[int, dict]:
        query = urlencode({"fingerprint": fingerprint, "since": _iso(since), "limit": limit})
        return self._request("GET", f"/articles?{query}")


# --- the reconciler --------------------------------------------------------------------------

# The service's fingerprint-free listing, matched on the intent's title and body: what the
# look-up falls back on while the key index is down (501). Reads that may predate the
# submission (`consistent_as_of`, the lag window) are NotYet, never proof of absence.
_recent_articles = reconcilers.list_and_match(
    None, url="{target}?since={since}&limit={limit}", items="items", match=("title", "body"),
    limit=20, consistent_as_of="consistent_as_of",
)


@reconcile.register("articles.create")
class ArticlesReconciler(reconcilers.http_lookup(
    None, url="{target}/by-key/{idempotency_key}", external_id="article.id",
    consistent_as_of="consistent_as_of", fall_back_on=(501,), search=_recent_articles,
    # Proof while no article on the target has succeeded yet to serve as a control (the
    # listing, when the key index is down, declares nothing: it needs one).
    trusted_absence="the service's key index answers 404 only for a key it never saw "
    "(reads complete up to consistent_as_of)",
)):
    """The kits of `ledger.reconcilers`, for the simulated service named by the target.

    lookup: GET <target>/by-key/<idempotency key> (404 absent, 200 found); while the key
    index answers 501, search: the newest 20 articles since shortly before the operation
    was recorded, matched on title and body, leaving out articles another operation owns.
    A target that is not the simulated service on 127.0.0.1 is never read: a person checks.
    """

    name = "articles.create (simulated service)"
    grace_period = timedelta(minutes=5)

    def lookup(self, op: Operation):
        return _elsewhere(op) or super().lookup(op)

    def search(self, op: Operation):
        return _elsewhere(op) or super().search(op)


def _elsewhere(op: Operation):
    parts = urlsplit(op.target)
    if parts.scheme == "http" and parts.hostname == HOST and parts.port is not None:
        return None
    return reconcile.Ambiguous(
        reason=f"target {op.target!r} is not a simulated articles service on {HOST}; "
        "a person must check it"
    )


def demo_articles_port() -> int:
    """The port of the articles service the running demo serves: DEMO_ARTICLES_PORT, else
    the desk's port + DEMO_ARTICLES_PORT_OFFSET. The seed targets it, the demo serves it."""
    import os

    from django.conf import settings

    named = os.environ.get("DEMO_ARTICLES_PORT", "").strip()
    if named:
        if not named.isdigit() or not 0 < int(named) < 65536:
            raise ValueError(f"expected DEMO_ARTICLES_PORT to be a port (1-65535), found "
                             f"{named!r}")
        return int(named)
    desk_port = urlsplit(settings.LEDGER_DESK_URL).port or 8000
    return desk_port + DEMO_ARTICLES_PORT_OFFSET


def demo_articles_url() -> str:
    """The articles URL of the service the running demo serves (`demo_articles_port`)."""
    return f"http://{HOST}:{demo_articles_port()}/articles"


def demo_articles_file() -> Path:
    """Where the demo's articles service keeps its articles from one process to the next:
    the seed's service writes what its agents created, Procfile.demo's `demo_articles`
    starts with it and writes it back when it stops. DEMO_ARTICLES_FILE, else
    .local/demo-articles-<port>.json beside the project (`demo_articles_port`)."""
    import os

    from django.conf import settings

    named = os.environ.get("DEMO_ARTICLES_FILE", "").strip()
    if named:
        return Path(named)
    return Path(settings.BASE_DIR) / ".local" / f"demo-articles-{demo_articles_port()}.json"


def load_articles(path: Path) -> list[dict[str, Any]]:
    """The articles `save_articles` wrote to `path`; none when there is no file yet."""
    try:
        articles = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    if not isinstance(articles, list) or not all(isinstance(a, dict) for a in articles):
        raise ValueError(f"expected a JSON list of articles in {path}, found "
                         f"{type(articles).__name__}")
    return articles


def save_articles(path: Path, articles: list[dict[str, Any]]) -> None:
    """Write `articles` to `path` whole (a reader never sees half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.partial")
    partial.write_text(json.dumps(articles, indent=1))
    partial.replace(path)
