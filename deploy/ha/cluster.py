#!/usr/bin/env python3
"""A PostgreSQL primary and a synchronous standby under Patroni, with one etcd, on this
machine (Debian's packages: patroni, etcd-server, postgresql-15), data and logs under
.local/ha. `make ha-up` / `make ha-down`; `python deploy/ha/cluster.py status`.

    up      start etcd and two Patroni nodes (node1 on PORTS[0], node2 on PORTS[1]); wait
            for a leader and a synchronous standby; print the libpq URL to connect with
    down    stop them (SIGTERM, then SIGKILL), data kept; `down --wipe` removes .local/ha
    status  the members, their roles and lag (Patroni's REST API)
    kill    SIGKILL the leader's Patroni and its PostgreSQL: the machine lost
    url     the libpq multi-host URL of database NAME (`url NAME`)

The application connects with libpq's multi-host URL and target_session_attrs=read-write
(URL below): a connection goes to whichever node is primary now. Patroni's synchronous
mode sets synchronous_standby_names to the standby, with synchronous_commit on: a COMMIT
is acknowledged once the standby has its WAL, so the standby Patroni promotes has every
acknowledged commit. PostgreSQL refuses to run as root: run as root, the nodes run as the
`postgres` system user.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HA = Path(os.environ.get("LEDGER_HA_DIR", ROOT / ".local" / "ha"))
PORTS = (5441, 5442)            # PostgreSQL of node1, node2
REST = (8441, 8442)             # Patroni's REST API of node1, node2
ETCD_CLIENT, ETCD_PEER = 2391, 2392
SCOPE = "ledger-ha"
BIN_DIR = os.environ.get("LEDGER_PG_BIN", "/usr/lib/postgresql/15/bin")
NAMES = ("node1", "node2")
# Patroni's timing: the leader key lives TTL s without renewal; a standby promotes once it
# has expired. Short, for a test on one machine; production keeps Patroni's defaults (30).
TTL, LOOP_WAIT, RETRY_TIMEOUT = 10, 1, 3

URL_HOSTS = ",".join(f"127.0.0.1:{p}" for p in PORTS)


def database_url(database: str = "postgres", user: str = "postgres") -> str:
    return (f"postgres://{user}@{URL_HOSTS}/{database}"
            "?target_session_attrs=read-write&connect_timeout=2")


def missing() -> list[str]:
    need = {"etcd": shutil.which("etcd") or "/usr/bin/etcd",
            "patroni": shutil.which("patroni") or "/usr/bin/patroni",
            "postgres": f"{BIN_DIR}/postgres"}
    return [name for name, path in need.items() if not Path(path).is_file()]


def _as_postgres() -> dict:
    """Popen's arguments that run a child as the postgres system user when this runs as
    root (PostgreSQL refuses root); the child's pid is then the server's own process."""
    if os.geteuid() != 0:
        return {}
    entry = pwd.getpwnam("postgres")  # KeyError: no such user (postgresql-15 makes it)
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": [],
            "env": dict(os.environ, HOME=str(HA), USER="postgres", LOGNAME="postgres")}


def _chown(path: Path) -> None:
    if os.geteuid() == 0:
        entry = pwd.getpwnam("postgres")
        os.chown(path, entry.pw_uid, entry.pw_gid)


def _node_config(i: int) -> str:
    name, node = NAMES[i], HA / NAMES[i]
    return json.dumps({
        "scope": SCOPE, "name": name,
        "log": {"level": "WARNING", "dir": str(node)},
        "restapi": {"listen": f"127.0.0.1:{REST[i]}", "connect_address": f"127.0.0.1:{REST[i]}"},
        "etcd": {"host": f"127.0.0.1:{ETCD_CLIENT}"},
        "bootstrap": {
            "dcs": {
                "ttl": TTL, "loop_wait": LOOP_WAIT, "retry_timeout": RETRY_TIMEOUT,
                "maximum_lag_on_failover": 1048576,
                "synchronous_mode": True,
                "postgresql": {"use_pg_rewind": True, "parameters": {
                    "synchronous_commit": "on", "wal_level": "replica", "hot_standby": "on",
                    "max_wal_senders": 5, "max_replication_slots": 5, "wal_log_hints": "on",
                    "max_connections": 200}},
            },
            "initdb": [{"encoding": "UTF8"}, {"locale": "C.UTF-8"}, {"auth-local": "trust"},
                       {"auth-host": "trust"}],
        },
        "postgresql": {
            "listen": f"127.0.0.1:{PORTS[i]}", "connect_address": f"127.0.0.1:{PORTS[i]}",
            "data_dir": str(node / "data"), "bin_dir": BIN_DIR,
            "pgpass": str(node / "pgpass"),
            "authentication": {"superuser": {"username": "postgres", "password": "ha-local"},
                               "replication": {"username": "postgres", "password": "ha-local"}},
            "pg_hba": ["local all all trust", "host all all 127.0.0.1/32 trust",
                       "host replication all 127.0.0.1/32 trust"],
            "parameters": {"unix_socket_directories": str(node)},
        },
        "tags": {"nofailover": False, "noloadbalance": False, "clonefrom": False},
    }, indent=1)


def _spawn(name: str, argv: list[str]) -> None:
    log = open(HA / f"{name}.log", "a")  # noqa: SIM115 - the child holds it
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=HA, **_as_postgres())
    (HA / f"{name}.pid").write_text(str(proc.pid))


def _alive(name: str) -> int | None:
    pidfile = HA / f"{name}.pid"
    if not pidfile.exists():
        return None
    pid = int(pidfile.read_text())
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    return pid


def members() -> list[dict]:
    for port in REST:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/cluster", timeout=2) as r:
                return json.load(r)["members"]
        except (OSError, ValueError, KeyError):
            continue
    return []


def leader() -> dict | None:
    return next((m for m in members() if m.get("role") == "leader"
                 and m.get("state") == "running"), None)


def up(timeout: float = 120) -> None:
    if missing():
        sys.exit(f"expected {', '.join(missing())} installed (apt-get install patroni "
                 "etcd-server postgresql-15), found none")
    HA.mkdir(parents=True, exist_ok=True)
    _chown(HA)
    if not _alive("etcd"):
        (HA / "etcd").mkdir(exist_ok=True)
        _chown(HA / "etcd")
        _spawn("etcd", ["etcd", "--name", "ha", "--data-dir", str(HA / "etcd"),
                        "--enable-v2=true",
                        "--listen-client-urls", f"http://127.0.0.1:{ETCD_CLIENT}",
                        "--advertise-client-urls", f"http://127.0.0.1:{ETCD_CLIENT}",
                        "--listen-peer-urls", f"http://127.0.0.1:{ETCD_PEER}",
                        "--initial-advertise-peer-urls", f"http://127.0.0.1:{ETCD_PEER}",
                        "--initial-cluster", f"ha=http://127.0.0.1:{ETCD_PEER}"])
        _wait(lambda: _etcd_ok(), 30, "etcd to answer")
    for i, name in enumerate(NAMES):
        node = HA / name
        node.mkdir(exist_ok=True)
        node.chmod(0o700)
        _chown(node)
        config = node / "patroni.yml"  # JSON is YAML
        config.write_text(_node_config(i))
        _chown(config)
        if not _alive(name):
            _spawn(name, ["patroni", str(config)])
    # Both nodes first: after a failover the node started first may be the one that must
    # follow the other.
    _wait(lambda: leader() is not None, timeout, "a leader")
    _wait(lambda: any(m.get("role") == "sync_standby" and m.get("state") in
                      ("running", "streaming") for m in members()),
          timeout, "a synchronous standby")
    _wait(_writable, timeout, "the primary to take writes through the URL")
    print(f"primary {leader()['name']}; connect with {database_url()}")


def _writable() -> bool:
    """Whether a connection through the multi-host URL takes a write (a CREATE DATABASE
    included: Patroni's leader may still be read-only for a moment after it says leader)."""
    import psycopg

    try:
        with psycopg.connect(database_url(), autocommit=True) as conn:
            conn.execute("CREATE TEMP TABLE ha_probe (x int)")
            return conn.execute("SHOW default_transaction_read_only").fetchone()[0] != "on"
    except psycopg.Error:
        return False


def _etcd_ok() -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ETCD_CLIENT}/health", timeout=1):
            return True
    except OSError:
        return False


def _wait(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    tails = "\n".join(f"--- {p.name}\n" + p.read_text(errors="replace")[-2000:]
                      for p in sorted(HA.glob("*.log")) + sorted(HA.glob("node*/*.log")))
    sys.exit(f"expected {what} within {timeout:g} s, found none; members: {members()}\n{tails}")


def _postmaster(name: str) -> int | None:
    pidfile = HA / name / "data" / "postmaster.pid"
    try:
        return int(pidfile.read_text().splitlines()[0])
    except (OSError, ValueError, IndexError):
        return None


def kill_leader() -> str:
    """SIGKILL the leader's Patroni and its PostgreSQL (the machine lost); its name."""
    current = leader()
    if current is None:
        sys.exit("expected a leader to kill, found none")
    name = current["name"]
    for pid in (_alive(name), _postmaster(name)):
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return name


def down(wipe: bool = False) -> None:
    for name in (*NAMES, "etcd"):
        pid = _alive(name)
        if pid:
            os.kill(pid, signal.SIGTERM)
            for _ in range(100):
                if not _alive(name):
                    break
                time.sleep(0.1)
            else:
                os.kill(pid, signal.SIGKILL)
        if name != "etcd":
            postmaster = _postmaster(name)
            if postmaster:
                try:
                    os.kill(postmaster, signal.SIGKILL)  # orphaned by a killed Patroni
                except ProcessLookupError:
                    pass
    if wipe and HA.exists():
        shutil.rmtree(HA)
    print("stopped" + (" and wiped" if wipe else ""))


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else "status"
    if command == "up":
        up()
    elif command == "down":
        down(wipe="--wipe" in sys.argv)
    elif command == "kill":
        print(f"killed {kill_leader()}")
    elif command == "url":
        print(database_url(sys.argv[2] if len(sys.argv) > 2 else "postgres"))
    elif command == "status":
        print(json.dumps(members(), indent=1))
    else:
        sys.exit(f"expected up, down, status, kill or url, found {command!r}")
