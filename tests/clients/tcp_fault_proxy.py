"""A TCP proxy on loopback between a client and a real ledger server that loses answers:
`TcpFaultProxy(upstream, drop_answers={b"POST /api/v1/operations ": 1})` forwards every
byte both ways, except that the first N requests starting with a given request line reach
the server whole (their effect is committed) and their answer is thrown away: the proxy
closes the client's connection instead, as a dropped network path would."""

from __future__ import annotations

import socket
import threading


class TcpFaultProxy:
    def __init__(self, upstream: tuple[str, int], *, drop_answers: dict[bytes, int]):
        self.upstream = upstream
        self.drop_answers = dict(drop_answers)
        self.dropped: list[bytes] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            self._open += [client, server]
            losing = threading.Event()
            threading.Thread(target=self._requests, args=(client, server, losing),
                             daemon=True).start()
            threading.Thread(target=self._answers, args=(server, client, losing),
                             daemon=True).start()

    def _requests(self, client: socket.socket, server: socket.socket,
                  losing: threading.Event) -> None:
        while True:
            try:
                data = client.recv(65536)
            except OSError:
                data = b""
            if not data:
                _close(server)
                return
            with self._lock:
                for line, left in self.drop_answers.items():
                    if left and data.startswith(line):
                        self.drop_answers[line] = left - 1
                        self.dropped.append(line)
                        losing.set()  # set before the server can answer it
            try:
                server.sendall(data)
            except OSError:
                _close(client)
                return

    def _answers(self, server: socket.socket, client: socket.socket,
                 losing: threading.Event) -> None:
        while True:
            try:
                data = server.recv(65536)
            except OSError:
                data = b""
            if not data or losing.is_set():
                # an answer to lose: the request reached the server, its answer never arrives
                _close(client)
                _close(server)
                return
            try:
                client.sendall(data)
            except OSError:
                _close(server)
                return

    def close(self) -> None:
        _close(self._listener)
        for sock in self._open:
            _close(sock)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
