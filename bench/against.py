"""Writers on threads for a few seconds, and the child process of `p10_dbos.py --against`.

`run_writers` is one side of one round: a function in a loop on some threads for some
seconds. P10 runs its own sides with it, and so does the child, which runs the action of
another checkout of the project (an older tree, say) in a process of its own:

    python bench/against.py CHECKOUT     # started by p10_dbos.py, never by hand

The child's `sys.path` is that checkout (not this tree), its database the one the parent
names in LEDGER_DATABASE_NAME (migrated by that checkout's own `manage.py migrate`). It
reads one JSON request a line on stdin and answers one JSON line on the pipe that was its
stdout (its own prints and logs go to stderr):

    {"forms": {side: how it runs}}                     first, once set up
    {"warm": n}                      -> {"warmed": n}   n actions of every side
    {"analyze": [table, ...]}        -> {"analyzed": [...]}  ANALYZE them
    {"side": s, "writers": w, "seconds": t}
                                     -> {"calls": n, "elapsed": t, "samples": [s, ...]}

and exits at the end of its stdin. This module imports nothing but the standard library
at its top, so the child can load it without this tree on its path.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path


def run_writers(fn: Callable[[], object], writers: int,
                seconds: float) -> tuple[int, float, list[float]]:
    """`fn` in a loop on `writers` threads for `seconds`: (calls made, seconds taken, each
    call's duration). Each thread closes its database connection; the first error raises."""
    from django.db import connection

    stop = time.monotonic() + seconds
    samples: list[list[float]] = [[] for _ in range(writers)]
    errors: list[BaseException] = []

    def writer(k: int) -> None:
        try:
            while time.monotonic() < stop:
                started = time.perf_counter()
                fn()
                samples[k].append(time.perf_counter() - started)
        except BaseException as exc:  # noqa: BLE001 - reported by the calling thread
            errors.append(exc)
        finally:
            connection.close()

    started = time.perf_counter()
    threads = [threading.Thread(target=writer, args=(k,)) for k in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise errors[0]
    flat = [s for part in samples for s in part]
    return len(flat), elapsed, flat


def action_sides(receipts, run: str) -> tuple[dict[str, Callable[[], object]], dict[str, str]]:
    """The checkout's action as P10 declares it, in the forms its `receipts.action` has:
    ({side: one call}, {side: how it runs}). "against" is the intent and its submission in
    one commit (`submit=True`) where the decorator takes `submit=`, else the decorator as
    it is (record, submit, outcome: three commits); "against, 3 commits" is `submit=False`,
    run only where `submit=` exists."""
    counter = itertools.count()
    declared = {"target": "https://cms.example/api",
                "key": lambda title: f"p10-{run}-{title}",
                "external_id": lambda value: value["id"]}

    def external_call(title: str) -> dict:
        return {"id": f"ext-{title}"}

    def declare(**form):
        decorate = receipts.action("bench.p10", **declared, **form)
        publish = decorate(external_call)
        return lambda: publish(str(next(counter)))

    try:
        two_commits = declare(submit=True)
    except TypeError as exc:
        if "submit" not in str(exc):
            raise
        return ({"against": declare()},
                {"against": "receipts.action without submit= (record, submit, outcome: "
                            "3 commits)"})
    return ({"against": two_commits, "against, 3 commits": declare(submit=False)},
            {"against": "receipts.action(submit=True) (2 commits)",
             "against, 3 commits": "receipts.action(submit=False) (3 commits)"})


def serve(checkout: Path) -> None:
    """The child's loop (see the module's docstring)."""
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # the checkout's prints: not the pipe
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    import django
    from django.conf import settings

    settings.DEBUG = False  # as bench.common.setup_django: no query log in memory
    django.setup()
    from ledger import receipts

    for package in ("config", "ledger"):  # the venv's editable install names another tree
        found = Path(sys.modules[package].__file__).resolve()
        if not found.is_relative_to(checkout):
            raise SystemExit(f"expected the {package} package of {checkout}, found {found}")
    sides, forms = action_sides(receipts, uuid.uuid4().hex[:10])
    answers.write(json.dumps({"forms": forms}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        if "analyze" in request:  # what autovacuum would do, where the server does not
            from django.db import connection

            with connection.cursor() as cursor:
                cursor.execute(f"ANALYZE {', '.join(request['analyze'])}")
            answers.write(json.dumps({"analyzed": request["analyze"]}) + "\n")
            continue
        if "warm" in request:
            for _ in range(request["warm"]):
                for fn in sides.values():
                    fn()
            answers.write(json.dumps({"warmed": request["warm"]}) + "\n")
            continue
        calls, elapsed, samples = run_writers(sides[request["side"]], request["writers"],
                                              request["seconds"])
        answers.write(json.dumps({"calls": calls, "elapsed": elapsed,
                                  "samples": samples}) + "\n")


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    root = Path(sys.argv[1]).resolve()
    # The checkout, and not this tree's bench/ (where Python put this script's directory).
    sys.path[:] = [str(root)] + [p for p in sys.path if Path(p or ".").resolve() != here]
    os.chdir(root)
    serve(root)
