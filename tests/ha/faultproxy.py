"""A TCP proxy between the application and PostgreSQL that loses the server's answer to a
chosen statement: the statement reaches the server and runs (a COMMIT commits, an
autocommit write commits), and the client never hears back, as when a network cut falls
after the server's commit and before its answer.

It reads the frontend protocol (typed messages after the startup packet): when a simple
Query, a Parse or a Bind carries `pattern`, it cuts at that statement's end (the Query
itself, or the next Sync), keeps relaying to the server, discards everything the server
answers up to its ReadyForQuery (the statement done), then closes both sides. Each `arm()`
cuts once; `cuts` counts them. Encryption requests are refused (the client goes on in
clear, as on loopback).
"""

from __future__ import annotations

import socket
import struct
import threading

SSL_REQUEST = 80877103
GSSENC_REQUEST = 80877104


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


class FaultProxy:
    def __init__(self, host: str, port: int | str):
        self.upstream = (host or "127.0.0.1", int(port or 5432))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._lock = threading.Lock()
        self._armed: list[bytes] = []
        self.cuts: list[bytes] = []
        self.connections = 0
        self._open: list[socket.socket] = []
        self._stopped = False
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting and cut every connection still open (their server sessions end)."""
        self._stopped = True
        self.listener.close()
        for sock in self._open:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def arm(self, pattern: bytes) -> None:
        """Lose the answer to the next statement (on any connection) carrying `pattern`."""
        with self._lock:
            self._armed.append(pattern)

    def _take(self, message: bytes) -> bytes | None:
        with self._lock:
            for pattern in self._armed:
                if pattern in message:
                    self._armed.remove(pattern)
                    return pattern
        return None

    def _connect(self) -> socket.socket:
        host, port = self.upstream
        if host.startswith("/"):  # a server on a Unix socket (the embedded one)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(f"{host}/.s.PGSQL.{port}")
            return sock
        return socket.create_connection((host, int(port)))

    def _accept(self) -> None:
        while not self._stopped:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            while True:  # the untyped packets: encryption requests, then the startup
                length = struct.unpack("!I", _recv_exact(client, 4))[0]
                body = _recv_exact(client, length - 4)
                code = struct.unpack("!I", body[:4])[0]
                if code in (SSL_REQUEST, GSSENC_REQUEST):
                    client.sendall(b"N")
                    continue
                break
            server = self._connect()
            self._open.append(server)
            server.sendall(struct.pack("!I", length) + body)
        except (OSError, ConnectionError):
            client.close()
            return
        state = {"cutting": False, "pattern": None}
        done = threading.Event()
        threading.Thread(target=self._answers, args=(server, client, state, done),
                         daemon=True).start()
        try:
            pending = None
            while not done.is_set():
                kind = _recv_exact(client, 1)
                length = struct.unpack("!I", _recv_exact(client, 4))[0]
                body = _recv_exact(client, length - 4)
                message = kind + struct.pack("!I", length) + body
                if pending is None and kind in (b"Q", b"P", b"B"):
                    pending = self._take(body)
                if pending is not None and kind in (b"Q", b"S"):
                    state["pattern"], state["cutting"] = pending, True
                    pending = None
                server.sendall(message)
        except (OSError, ConnectionError):
            pass
        finally:
            if not state["cutting"]:  # the client went away: so does its server session
                try:
                    server.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            done.wait(timeout=10)
            for sock in (client, server):
                try:
                    sock.close()
                except OSError:
                    pass

    def _answers(self, server, client, state, done) -> None:
        """Relay the server's messages; once cutting, swallow them to the ReadyForQuery
        that ends the statement, then close both sides."""
        try:
            while True:
                kind = _recv_exact(server, 1)
                length = struct.unpack("!I", _recv_exact(server, 4))[0]
                body = _recv_exact(server, length - 4)
                if state["cutting"]:
                    if kind == b"Z":
                        self.cuts.append(state["pattern"])
                        break
                    continue
                client.sendall(kind + struct.pack("!I", length) + body)
        except (OSError, ConnectionError):
            pass
        finally:
            done.set()
            for sock in (client, server):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
