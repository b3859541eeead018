"""deploy/: a systemd unit per process of the Procfile, running the same command, and a
Grafana dashboard that shows every metric /metrics exports."""

from __future__ import annotations

import configparser
import json
import re

import pytest

from ledger import metrics
from tests.support.honcho import ROOT, process_names

SYSTEMD = ROOT / "deploy" / "systemd"
CHECKOUT = "/srv/agent-ledger"


def unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read_string((SYSTEMD / name).read_text())
    return parser


def procfile() -> dict[str, str]:
    return dict(re.findall(r"^(\w+): (.+)$", (ROOT / "Procfile").read_text(), re.M))


@pytest.mark.parametrize("process", process_names("Procfile"))
def test_each_process_of_the_procfile_has_a_unit_running_the_same_command(process):
    service = unit(f"agent-ledger-{process}.service")
    # the Procfile's login choice (LEDGER_<PROCESS>_LOGIN under `make serve`) is the
    # unit's EnvironmentFile: its DATABASE_URL or LEDGER_DATABASE_USER
    login, command = procfile()[process].split(" ", 1)
    assert login == (f"LEDGER_DATABASE_USER=${{LEDGER_{process.upper()}_LOGIN-"
                     f"$LEDGER_DATABASE_USER}}")
    command = command.replace(".venv/bin/", f"{CHECKOUT}/.venv/bin/")
    assert service["Service"]["ExecStart"] == command
    assert service["Service"]["WorkingDirectory"] == CHECKOUT
    assert service["Service"]["Restart"] == "on-failure"
    assert service["Install"]["WantedBy"] == "agent-ledger.target"
    assert f"agent-ledger-{process}.service" in unit("agent-ledger.target")["Unit"]["Wants"]


def test_the_purge_timer_runs_the_purge_then_verifies_the_audit_trail():
    service = unit("agent-ledger-purge.service")["Service"]
    assert service["Type"] == "oneshot"
    assert "manage.py purge" in service["ExecStart"]
    assert "manage.py verify_audit" in service["ExecStartPost"]
    timer = unit("agent-ledger-purge.timer")["Timer"]
    assert timer["OnCalendar"] and timer["Persistent"] == "true"


@pytest.mark.django_db
def test_the_dashboard_shows_every_metric_the_ledger_exports():
    # every family a scrape declares (with or without samples yet), by the name Prometheus
    # stores its samples under (a counter's ends in `_total`)
    exported = {name if kind != "counter" or name.endswith("_total") else f"{name}_total"
                for name, kind in re.findall(r"^# TYPE (\w+) (\w+)$",
                                             metrics.render().decode(), re.M)}
    assert len(exported) >= 10
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "agent-ledger.json").read_text())
    expressions = " ".join(t["expr"] for panel in dashboard["panels"]
                           for t in panel["targets"])
    runbook = (ROOT / "docs" / "operations.md").read_text()
    for name in exported:
        assert re.search(rf"\b{name}\b", expressions), f"expected a panel of {name}"
        assert f"`{name}" in runbook, f"expected the runbook to name {name}"


@pytest.mark.parametrize("name", sorted(p.name for p in SYSTEMD.glob("*.service")))
def test_no_unit_may_write_its_own_code(name):
    """ProtectSystem=strict makes everything read-only but the unit's ReadWritePaths and
    StateDirectory: none of them may hold the checkout or its venv (docs/operations.md)."""
    service = unit(name)["Service"]
    assert service["ProtectSystem"] == "strict" and service["NoNewPrivileges"] == "true"
    writable = service.get("ReadWritePaths", "").split()
    writable += [f"/var/lib/{d}" for d in service.get("StateDirectory", "").split()]
    assert writable, f"expected {name} to name where its data lives, found nothing writable"
    for path in writable:
        assert not (CHECKOUT.startswith(path.rstrip("/") + "/") or path == CHECKOUT
                    or path.startswith(CHECKOUT + "/")), (
            f"expected {name} to write only where data lives, found {path} (the code)")
