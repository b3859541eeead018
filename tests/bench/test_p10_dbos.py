"""bench/p10_dbos.py --against: another checkout's action in a child process beside this
tree's sides and DBOS, run tiny with a copy of HEAD as the other checkout."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import tarfile
from types import SimpleNamespace

import psycopg
import pytest
from django.conf import settings
from psycopg import sql

from bench.against import action_sides
from tests.support.processes import ROOT

pytest.importorskip("dbos", reason="P10 needs DBOS Transact: pip install -e '.[bench]'")


@pytest.fixture
def bench_database():
    """A bench database of this test's own; it and every `_against_` database P10 made
    beside it are dropped after."""
    name = f"{settings.DATABASES['default']['NAME']}_p10test"
    yield name
    db = settings.DATABASES["default"]
    params = {"dbname": "postgres", "user": db.get("USER"), "password": db.get("PASSWORD"),
              "host": db.get("HOST"), "port": db.get("PORT")}
    with psycopg.connect(**{k: v for k, v in params.items() if v}, autocommit=True) as conn:
        made = conn.execute("SELECT datname FROM pg_database WHERE datname = %s"
                            " OR starts_with(datname, %s)", [name, f"{name}_against_"]).fetchall()
        for (made_name,) in made:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)")
                         .format(sql.Identifier(made_name)))


@pytest.fixture
def head_checkout(tmp_path):
    """The files of HEAD (`git archive`), as another checkout of the project."""
    archive = subprocess.run(["git", "archive", "--format=tar", "HEAD"], cwd=ROOT,
                             capture_output=True)
    if archive.returncode != 0:
        pytest.skip(f"needs the project as a git checkout: {archive.stderr.decode()[:200]}")
    checkout = tmp_path / "head"
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(checkout, filter="data")
    return checkout


def test_against_runs_the_other_checkout_beside_this_tree_and_records_the_ratios(
        bench_database, head_checkout, tmp_path):
    results_path = tmp_path / "results.json"
    env = {k: v for k, v in os.environ.items() if k != "LEDGER_DATABASE_NAME"}
    env.update(LEDGER_BENCH_DATABASE=bench_database, LEDGER_BENCH_RESULTS=str(results_path))
    done = subprocess.run(
        [sys.executable, "bench/p10_dbos.py", "--against", str(head_checkout),
         "--rounds", "2", "--seconds", "0.2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    report = done.stdout + done.stderr
    assert done.returncode == 0, report

    # HEAD's decorator takes submit=: the child runs both of its forms, in the copy.
    assert (f"against             receipts.action(submit=True) (2 commits), in {head_checkout}"
            in done.stdout), report
    assert (f"against, 3 commits  receipts.action(submit=False) (3 commits), in "
            f"{head_checkout}" in done.stdout), report
    assert re.search(rf"against's database +{bench_database}_against_[0-9a-f]{{8}}$",
                     done.stdout, re.MULTILINE), report
    for writers in (1, 8):
        table = done.stdout.split(f"P10 an action, {writers} writer(s)")[1].split("\n\n")[0]
        for side in ("ledger", "ledger, 3 commits", "DBOS", "against", "against, 3 commits"):
            assert re.search(rf"^{re.escape(side)} +\d+ actions/s, median [\d.]+ ms, p99 ",
                             table, re.MULTILINE), report
        assert re.search(r"^this tree / against \(throughput\) +[\d.]+x; in 3 commits "
                         r"[\d.]+x \(against, 3 commits\)$", table, re.MULTILINE), report

    p10 = json.loads(results_path.read_text())["P10"]
    assert p10["against"]["root"] == str(head_checkout)
    assert p10["against"]["database"].startswith(f"{bench_database}_against_")
    for writers in (1, 8):
        entry = p10[f"writers_{writers}"]
        assert entry["against"]["actions_per_s"] > 0 and entry["against"]["p99_ms"] > 0
        assert entry["against, 3 commits"]["actions_per_s"] > 0
        assert entry["ratio_against"] == pytest.approx(
            entry["ledger"]["actions_per_s"] / entry["against"]["actions_per_s"])
        assert entry["ratio_against_three_commits"] == pytest.approx(
            entry["ledger, 3 commits"]["actions_per_s"]
            / entry["against, 3 commits"]["actions_per_s"])
    assert p10["against"]["ratio"] == p10["writers_1"]["ratio_against"]
    assert p10["against"]["ratio_8"] == p10["writers_8"]["ratio_against"]


def test_against_runs_a_decorator_without_submit_as_it_is_in_three_commits():
    declared = []

    def action(operation, *, target, key=None, external_id=None):  # an older tree's signature
        def decorate(fn):
            def run(title):
                declared.append(key(title))
                return fn(title)
            return run
        return decorate

    sides, forms = action_sides(SimpleNamespace(action=action), "r1")

    assert forms == {"against": "receipts.action without submit= (record, submit, outcome: "
                                "3 commits)"}
    sides["against"]()
    sides["against"]()
    assert declared == ["p10-r1-0", "p10-r1-1"]


def test_against_does_not_take_another_type_error_for_a_missing_submit():
    def action(operation, *, target, key=None, external_id=None, submit=False):
        raise TypeError("expected target to be a URL")

    with pytest.raises(TypeError, match="expected target to be a URL"):
        action_sides(SimpleNamespace(action=action), "r1")
