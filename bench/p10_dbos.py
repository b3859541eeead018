"""P10: the ledger's action beside DBOS Transact's workflow with one step, on one server.

The same action on both sides: a call to an external system (here a function that returns
its id at once, so that only what each side records is measured), made at most once per
key. The ledger's side is a `@receipts.action` (the intent and its submission in one
commit, then the outcome: two commits, three events; and, beside it, the same with
`submit=False`, three commits); DBOS's is a workflow whose id is the key, with one step
that makes the call (its status, the step's output, the workflow's result, in DBOS's
system tables on the same PostgreSQL server, schema `dbos` of the bench database).

At 1 writer and at 8 (threads of this process, each side in turn for a few seconds,
alternating who goes first, in interleaved rounds), it prints each side's throughput and
latency, and the ratios ledger / DBOS (throughput; above 1, the ledger does more actions
a second). DBOS is a benchmark-only extra (`pip install -e '.[bench]'`); without it, P10
says so and skips.

With `--against PATH` (another checkout of the project, e.g. `git worktree add /tmp/old
f39b862`), that tree's action runs beside these, round by round, in a child process of its
own (bench/against.py: its `sys.path` is that checkout, the interpreter this one) on a
database of its own on the same server (`<bench database>_against_<digest of its
migrations>`, migrated by that tree's `manage.py migrate`: an older tree has other
migrations). Its action takes the forms its decorator has (`submit=True`, else the
decorator as it is; printed), and P10 adds the ratios this tree / against, throughput, at
1 and 8 writers: the tree before a change, measured in the same run as the change.

    .venv/bin/python bench/p10_dbos.py --scale quick
    .venv/bin/python bench/p10_dbos.py --against /tmp/old
    .venv/bin/python bench/p10_dbos.py --against /tmp/old --rounds 2 --seconds 0.5
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import subprocess
import sys
import uuid
from functools import partial
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.against import run_writers
from bench.common import (
    BENCH_DATABASE,
    ROOT,
    Stopwatch,
    analyzer,
    database_url,
    ensure_database,
    ms,
    parse_args,
    print_table,
    quiet_server,
    record,
    setup_django,
)

# (rounds, seconds per side and round)
SCALES = {"quick": (3, 3.0), "full": (5, 6.0)}
WRITERS = (1, 8)


def dbos_or_none():
    try:
        import dbos
    except ImportError:
        return None
    return dbos


def system_database_url() -> str:
    """The bench database, as a SQLAlchemy URL for DBOS's system tables."""
    from django.conf import settings
    from sqlalchemy.engine import URL

    db = settings.DATABASES["default"]
    return URL.create("postgresql+psycopg", username=db.get("USER") or None,
                      password=db.get("PASSWORD") or None, host=db.get("HOST") or None,
                      port=int(db["PORT"]) if db.get("PORT") else None,
                      database=db["NAME"]).render_as_string(hide_password=False)


class AgainstTree:
    """Another checkout's action, run in a child process (bench/against.py) on a database of
    its own, one side of one round at a time."""

    def __init__(self, root: Path):
        if not (root / "manage.py").is_file() or not (root / "ledger").is_dir():
            raise SystemExit(f"expected --against to name a checkout of the project (its "
                             f"manage.py and ledger/), found {root}")
        self.root = root
        self.database = against_database(root)
        ensure_database(self.database)
        env = dict(os.environ, DJANGO_SETTINGS_MODULE="config.settings",
                   LEDGER_DATABASE_NAME=self.database, PYTHONUNBUFFERED="1",
                   DATABASE_URL=database_url(self.database,
                                             application_name="bench-p10-against"))
        migrate = subprocess.run([sys.executable, "manage.py", "migrate", "--no-input",
                                  "--verbosity", "0"], cwd=root, env=env,
                                 capture_output=True, text=True)
        if migrate.returncode != 0:
            raise SystemExit(f"expected {root}'s manage.py migrate to migrate {self.database},"
                             f" found exit {migrate.returncode}:\n{migrate.stderr[-3000:]}")
        self.process = subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "against.py"), str(root)], cwd=root,
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.forms: dict[str, str] = self._answer()["forms"]

    def _answer(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"expected the child running {self.root}'s action to answer, "
                             f"found it exited {self.process.wait(timeout=30)} (its stderr "
                             "is above)")
        return json.loads(line)

    def _ask(self, request: dict) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._answer()

    def warm(self, count: int) -> None:
        self._ask({"warm": count})

    def analyze(self, tables: list[str]) -> None:
        self._ask({"analyze": tables})

    def run(self, side: str, writers: int, seconds: float) -> tuple[int, float, list[float]]:
        done = self._ask({"side": side, "writers": writers, "seconds": seconds})
        return done["calls"], done["elapsed"], done["samples"]

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process.stdout.close()


def against_database(root: Path) -> str:
    """The bench database's name + `_against_` + a digest of `root`'s migrations: a tree
    with other migrations gets another database, one with the same ones reuses it."""
    digest = hashlib.sha256()
    for path in sorted(root.glob("*/migrations/*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return f"{BENCH_DATABASE}_against_{digest.hexdigest()[:8]}"


def main() -> dict | None:
    args = parse_args(__doc__.splitlines()[0],
                      against={"type": Path, "default": None,
                               "help": "another checkout whose action runs beside these"},
                      rounds={"type": int, "default": None,
                              "help": "rounds (default: the scale's)"},
                      seconds={"type": float, "default": None,
                               "help": "seconds a side and round (default: the scale's)"})
    dbos = dbos_or_none()
    if dbos is None:
        print("P10 skipped: DBOS Transact is not installed; it is a benchmark-only extra: "
              "pip install -e '.[bench]' (or pip install dbos)")
        return None
    setup_django()
    from ledger import receipts

    rounds, seconds = SCALES[args.scale]
    rounds, seconds = args.rounds or rounds, args.seconds or seconds
    run = uuid.uuid4().hex[:10]
    counter = itertools.count()

    def external_call(title: str) -> dict:
        return {"id": f"ext-{title}"}

    @receipts.action("bench.p10", target="https://cms.example/api",
                     key=lambda title: f"p10-{run}-{title}",
                     external_id=lambda value: value["id"])
    def publish(title: str) -> dict:
        return external_call(title)

    @receipts.action("bench.p10", target="https://cms.example/api", submit=False,
                     key=lambda title: f"p10-{run}-{title}",
                     external_id=lambda value: value["id"])
    def publish_three_commits(title: str) -> dict:
        return external_call(title)

    dbos_app = dbos.DBOS(config={
        "name": "ledger-bench-p10", "system_database_url": system_database_url(),
        "log_level": "WARNING", "sys_db_pool_size": 20,
    })

    @dbos.DBOS.step()
    def dbos_step(title: str) -> dict:
        return external_call(title)

    @dbos.DBOS.workflow()
    def dbos_workflow(title: str) -> dict:
        return dbos_step(title)

    dbos.DBOS.launch()

    def ledger_action():
        publish(str(next(counter)))

    def ledger_action_three_commits():
        publish_three_commits(str(next(counter)))

    def dbos_action():
        title = str(next(counter))
        with dbos.SetWorkflowID(f"p10-{run}-{title}"):
            dbos_workflow(title)

    # side -> a round of it: (writers, seconds) -> (calls, seconds taken, each call's time)
    sides = {"ledger": partial(run_writers, ledger_action),
             "ledger, 3 commits": partial(run_writers, ledger_action_three_commits),
             "DBOS": partial(run_writers, dbos_action)}
    forms = {"ledger": "receipts.action (submit=True by default: 2 commits)",
             "ledger, 3 commits": "receipts.action(submit=False) (3 commits)",
             "DBOS": "DBOS.workflow with one DBOS.step, its id the key"}
    results: dict = {"scale": args.scale, "rounds": rounds, "seconds": seconds}
    against = None
    try:
        if args.against is not None:
            against = AgainstTree(args.against.resolve())
            for name, form in against.forms.items():
                sides[name] = partial(against.run, name)
                forms[name] = f"{form}, in {against.root}"
            against.warm(20)
        for _ in range(20):  # warm every side
            ledger_action()
            ledger_action_three_commits()
            dbos_action()
        quiet_server()
        if against:
            print_table("P10 sides", [*forms.items(), ("against's database", against.database)])
        names = list(sides)
        tables: list[str] = []  # the whole database: DBOS's tables too
        analyze = analyzer(tables)

        def analyze_both() -> None:  # untimed, before every round
            if analyze is not None:
                analyze()
                if against:
                    against.analyze(tables)

        for writers in WRITERS:
            watches = {name: Stopwatch(name) for name in names}
            done = {name: [0, 0.0] for name in names}
            for r in range(rounds):
                analyze_both()
                for name in names if r % 2 == 0 else names[::-1]:
                    calls, took, samples = sides[name](writers, seconds)
                    watches[name].samples.extend(samples)
                    done[name][0] += calls
                    done[name][1] += took
            per_s = {name: calls / took for name, (calls, took) in done.items()}
            entry = {
                name: {"actions_per_s": per_s[name],
                       "median_ms": watches[name].median * 1000,
                       "p99_ms": watches[name].percentile(0.99) * 1000}
                for name in names
            }
            entry["ratio"] = per_s["ledger"] / per_s["DBOS"]
            entry["ratio_three_commits"] = per_s["ledger, 3 commits"] / per_s["DBOS"]
            rows = [
                *((name, f"{per_s[name]:8.0f} actions/s, median "
                         f"{ms(watches[name].median)}, p99 {ms(watches[name].percentile(0.99))}")
                  for name in names),
                ("ledger / DBOS (throughput)", f"{entry['ratio']:.2f}x; in 3 commits "
                                               f"{entry['ratio_three_commits']:.2f}x"),
            ]
            if against:
                # Without submit= the older tree's one form is the 3-commit one.
                three = "against, 3 commits" if "against, 3 commits" in per_s else "against"
                entry["ratio_against"] = per_s["ledger"] / per_s["against"]
                entry["ratio_against_three_commits"] = per_s["ledger, 3 commits"] / per_s[three]
                rows.append(("this tree / against (throughput)",
                             f"{entry['ratio_against']:.2f}x; in 3 commits "
                             f"{entry['ratio_against_three_commits']:.2f}x ({three})"))
            results[f"writers_{writers}"] = entry
            print_table(f"P10 an action, {writers} writer(s), {rounds} rounds of "
                        f"{seconds:g} s a side", rows)
    finally:
        if against:
            against.close()
        dbos.DBOS.destroy()
        del dbos_app
    results["ratio"] = results["writers_1"]["ratio"]
    results["ratio_8"] = results["writers_8"]["ratio"]
    results["forms"] = forms
    results["against"] = None if against is None else {
        "root": str(against.root), "database": against.database,
        "ratio": results["writers_1"]["ratio_against"],
        "ratio_8": results["writers_8"]["ratio_against"],
        "ratio_three_commits": results["writers_1"]["ratio_against_three_commits"],
        "ratio_three_commits_8": results["writers_8"]["ratio_against_three_commits"],
    }
    record("P10", results)
    return results


if __name__ == "__main__":
    main()
