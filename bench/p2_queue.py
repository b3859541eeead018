"""P2: does the review desk stay fast as the ledger grows?

Seeds 10k unresolved operations (outcome_unknown and manual_review, some ambiguous, a few
duplicate pairs) with a bulk loader (INSERT ... SELECT over generate_series, in batches,
with progress; triggers off for the load, as for a restore), three events each and
evidence on the unresolved ones. Times the queue page, the operation detail and Django's
admin changelist of operations (the reference) through Django's test client; then grows
the same tables with resolved history to 1M operations (quick scale: 200k) and times them
again, then removes that history and times the small ledger once more. The claim is each
page's time at the large size over its mean time at the small one (before and after),
with its SQL query count at both sizes: the desk's cost follows the unresolved work, not
the history.
"""

from __future__ import annotations

import time
import uuid

if __package__ in (None, ""):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    Stopwatch,
    interleave,
    ms,
    parse_args,
    print_table,
    quiet_server,
    record,
    setup_django,
)

# (unresolved operations, all operations): the queue's work stays the same, history grows.
SCALES = {"quick": (10_000, 200_000), "full": (10_000, 1_000_000)}
BATCH = 100_000
ROUNDS = {"quick": 25, "full": 25}

# The unresolved work (the first %(unresolved)s operations: half outcome_unknown, half
# manual_review, every tenth of those ambiguous, a few duplicate pairs that both succeeded)
# comes first; everything after is resolved history.
_OPERATIONS = """
INSERT INTO ledger_operation (
    operation_id, tenant, operation, target, intent, intent_fingerprint, idempotency_key,
    retry_policy, state, version, attempt, external_id, error_code, error_detail,
    authentication_recorded, created_at, state_changed_at, submitted_at, completed_at,
    unknown_since, reconcile_attempts, reconcile_failures, conflict)
SELECT 'p2-' || %(tag)s || '-' || lpad(g::text, 8, '0'),
       'default',
       (ARRAY['articles.create', 'email.send', 'invoice.issue', 'crm.update'])[1 + g %% 4],
       'https://svc.example/api',
       jsonb_build_object('title', 'Item ' || g, 'body', repeat('x', 200)),
       'sha256:' || md5(s.twin::text) || md5('p2' || s.twin),
       'p2-' || %(tag)s || '-' || g,
       'if_absent_proven',
       s.state, 3, 1,
       CASE WHEN s.state = 'succeeded' THEN 'ext-' || g ELSE '' END,
       CASE WHEN s.state = 'succeeded' THEN '' ELSE 'TimeoutError' END,
       '', false,
       s.at, s.at + interval '2 seconds', s.at + interval '1 second',
       CASE WHEN s.state IN ('succeeded', 'rejected') THEN s.at + interval '2 seconds' END,
       CASE WHEN s.state IN ('outcome_unknown', 'manual_review')
            THEN s.at + interval '2 seconds' END,
       0, 0,
       CASE WHEN g <= %(unresolved)s AND g %% 1000 IN (1, 2) THEN 'duplicate'
            WHEN g <= %(unresolved)s AND g %% 20 = 0 THEN 'ambiguous'
            ELSE '' END
  FROM generate_series(%(first)s, %(last)s) g,
       LATERAL (SELECT CASE WHEN g <= %(unresolved)s AND g %% 1000 IN (1, 2) THEN 'succeeded'
                            WHEN g <= %(unresolved)s AND g %% 2 = 0 THEN 'manual_review'
                            WHEN g <= %(unresolved)s THEN 'outcome_unknown'
                            WHEN g %% 50 = 7 THEN 'rejected'
                            ELSE 'succeeded' END AS state,
                       CASE WHEN g <= %(unresolved)s AND g %% 1000 = 2 THEN g - 1
                            ELSE g END AS twin,
                       now() - %(days_ago)s * interval '1 day'
                           + (g %% 2000000) * interval '1 second' AS at) s
"""

_EVENTS = """
INSERT INTO ledger_operationevent (
    operation_id, tenant, version, from_state, to_state, actor_kind, actor_id, reason,
    evidence, fencing_token, created_at, chain_seq, chain_hash)
SELECT o.id, o.tenant, v,
       (ARRAY['', 'planned', 'submitted'])[v],
       (ARRAY['planned', 'submitted', o.state])[v],
       'agent', 'bench-agent', 'seeded', NULL, NULL,
       o.created_at + (v - 1) * interval '1 second',
       %(base)s + row_number() OVER (ORDER BY o.id, v), repeat('0', 64)
  FROM ledger_operation o, generate_series(1, 3) v
 WHERE o.operation_id BETWEEN %(lo)s AND %(hi)s
"""

# The seeded events take the next sequence numbers of the tenant's chain; the head then
# moves past them, so the agents writing after the load link on without a collision. (The
# seeded hashes are placeholders: the bench database's chain does not verify, by design.)
_CHAIN_BASE = """
SELECT COALESCE((SELECT seq FROM ledger_chainhead
                  WHERE chain = 'operation_events' AND tenant = 'default'), 0)
"""
_CHAIN_HEAD = """
INSERT INTO ledger_chainhead (chain, tenant, seq, hash)
SELECT 'operation_events', 'default', max(chain_seq), repeat('0', 64)
  FROM ledger_operationevent WHERE tenant = 'default'
HAVING max(chain_seq) IS NOT NULL
ON CONFLICT (chain, tenant) DO UPDATE SET seq = GREATEST(ledger_chainhead.seq, EXCLUDED.seq)
"""

_EVIDENCE = """
INSERT INTO ledger_evidence (operation_id, reconciler, query, observed, verdict, matched_by,
                             detail, created_at)
SELECT o.id, 'bench.Reconciler', jsonb_build_object('idempotency_key', o.idempotency_key),
       CASE WHEN o.state = 'manual_review'
                 AND o.conflict = 'ambiguous'
            THEN jsonb_build_object('matches', jsonb_build_array('a-1', 'a-2'))
            ELSE '{}'::jsonb END,
       CASE WHEN o.conflict = 'ambiguous' THEN 'ambiguous' ELSE 'not_yet' END,
       'fingerprint', 'seeded', o.state_changed_at
  FROM ledger_operation o
 WHERE o.operation_id BETWEEN %(lo)s AND %(hi)s
   AND o.state IN ('outcome_unknown', 'manual_review')
"""


# The desk's search rows (ledger.models.OperationSearch), which the operations' triggers
# write and the bulk load (triggers off) does not.
_SEARCH = """
INSERT INTO ledger_operationsearch (operation_id, kind, tenant, text)
SELECT o.id, k.kind, o.tenant,
       CASE k.kind WHEN 'receipt' THEN o.operation_id || E'\\x1f' || o.idempotency_key
                   ELSE o.external_id END
  FROM ledger_operation o, (VALUES ('receipt'), ('external')) k(kind)
 WHERE o.operation_id BETWEEN %(lo)s AND %(hi)s
   AND (k.kind = 'receipt' OR o.external_id <> '')
"""


def seed(tag: str, first: int, last: int, unresolved: int, days_ago: int = 30) -> None:
    """Bulk-load operations `first`..`last` (the first `unresolved` waiting on a person)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SET session_replication_role = replica")
        try:
            for start in range(first, last + 1, BATCH):
                stop = min(last, start + BATCH - 1)
                lo, hi = f"p2-{tag}-{start:08d}", f"p2-{tag}-{stop:08d}"
                started = time.perf_counter()
                cursor.execute(_OPERATIONS, {"tag": tag, "first": start, "last": stop,
                                             "unresolved": unresolved, "days_ago": days_ago})
                cursor.execute(_CHAIN_BASE)
                base = cursor.fetchone()[0]
                cursor.execute(_EVENTS, {"lo": lo, "hi": hi, "base": base})
                cursor.execute(_CHAIN_HEAD)
                cursor.execute(_EVIDENCE, {"lo": lo, "hi": hi})
                cursor.execute(_SEARCH, {"lo": lo, "hi": hi})
                print(f"  seeded operations {start:>9,}..{stop:>9,} with events and evidence "
                      f"in {time.perf_counter() - started:.1f} s", flush=True)
        finally:
            cursor.execute("SET session_replication_role = DEFAULT")
        cursor.execute("ANALYZE ledger_operation, ledger_operationevent, ledger_evidence,"
                       " ledger_operationsearch")


def unseed(tag: str, after: int) -> None:
    """Remove the operations past number `after` of a `seed` (the resolved history)."""
    from django.db import connection

    cut = f"p2-{tag}-{after:08d}"
    with connection.cursor() as cursor:
        cursor.execute("SET session_replication_role = replica")
        try:
            for table in ("ledger_evidence", "ledger_operationevent", "ledger_operationsearch"):
                cursor.execute(f"DELETE FROM {table} WHERE operation_id IN "
                               "(SELECT id FROM ledger_operation WHERE operation_id > %s)", [cut])
            cursor.execute("DELETE FROM ledger_operation WHERE operation_id > %s", [cut])
        finally:
            cursor.execute("SET session_replication_role = DEFAULT")
    vacuum()


def vacuum() -> None:
    """VACUUM ANALYZE the seeded tables, as autovacuum would have long before a ledger of
    that size is read. The seed is a bulk load: left to autovacuum, its vacuum may start
    after quiet_server() looked (which waits only for workers already running) and run
    beside the large side's pages, which then pay for it alone."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE ledger_operation, ledger_operationevent, ledger_evidence,"
                       " ledger_operationsearch")


def reset() -> None:
    """Empty the operations tables of the bench database (they hold nothing else's data)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE ledger_operation, ledger_operationevent, ledger_evidence,"
                       " ledger_redaction, ledger_operationsearch CASCADE")


def measure(clients, urls, rounds: int) -> dict[str, dict]:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    out = {}
    watches = {}
    for name, (who, url) in urls.items():
        client = clients[who]
        response = client.get(url)
        if response.status_code != 200:
            raise SystemExit(f"expected 200 from {url}, found {response.status_code}")
        with CaptureQueriesContext(connection) as captured:
            client.get(url)
        watches[name] = Stopwatch(name)
        out[name] = {"queries": len(captured.captured_queries)}

    def getter(client, url):
        return lambda: client.get(url)

    interleave(rounds, [(watches[name], getter(clients[who], url))
                        for name, (who, url) in urls.items()])
    for name, watch in watches.items():
        out[name]["median_ms"] = watch.median * 1000
    return out


def main() -> dict:
    args = parse_args(__doc__.splitlines()[0])
    setup_django()
    from django.contrib.auth.models import Group, User
    from django.test import Client

    from ledger import access
    from ledger.models import Operation
    from review.templatetags.desk import operation_url

    small, large = SCALES[args.scale]
    rounds = ROUNDS[args.scale]
    tag = uuid.uuid4().hex[:6]
    reset()

    reviewer, _ = User.objects.get_or_create(username="p2-reviewer")
    reviewer.groups.add(Group.objects.get(name="reviewer"))
    access.grant(reviewer, "default")
    admin, _ = User.objects.get_or_create(username="p2-admin",
                                          defaults={"is_staff": True, "is_superuser": True})
    clients = {"reviewer": Client(), "admin": Client()}
    clients["reviewer"].force_login(reviewer)
    clients["admin"].force_login(admin)

    # Small, large, small again (the history removed): the two ledgers cannot exist at once,
    # so the small one is measured on both sides of the large one and the ratio is taken
    # against their mean, which cancels the machine's drift between the phases.
    results = {}
    for size, first, last in (("small", 1, small), ("large", small + 1, large),
                              ("small again", None, small)):
        if first is None:
            print(f"removing the history past {last:,} operations", flush=True)
            unseed(tag, after=last)
        else:
            print(f"seeding up to {last:,} operations", flush=True)
            seed(tag, first, last, unresolved=small)
            vacuum()
        quiet_server()  # the pages are measured, not the server still writing out the load
        # the same kind of operation each time: the newest manual_review one
        op = Operation.objects.filter(state="manual_review").order_by("-id").first()
        urls = {
            "queue": ("reviewer", "/"),
            "queue, manual_review": ("reviewer", "/?state=manual_review"),
            "operation detail": ("reviewer", operation_url(op)),
            # a fragment of one key (the desk's search: the trigram index of the rows
            # beside the operations); the same key at every size
            "search by fragment": ("reviewer", f"/?q={tag}-00000077"),
            "admin changelist": ("admin", "/admin/ledger/operation/"),
        }
        results[size] = measure(clients, urls, rounds)
        results[size]["rows"] = last

    rows = []
    summary_pages = {}
    for name in results["small"]:
        if name == "rows":
            continue
        before, b, after = (results[size][name] for size in ("small", "large", "small again"))
        a = {"median_ms": (before["median_ms"] + after["median_ms"]) / 2,
             "queries": before["queries"], "queries_again": after["queries"]}
        ratio = b["median_ms"] / a["median_ms"]
        summary_pages[name] = {"ratio": ratio, "small": a, "large": b}
        rows.append((name, f"{ms(a['median_ms'] / 1000)} at {small:,}, "
                           f"{ms(b['median_ms'] / 1000)} at {large:,}: {ratio:.2f}x; "
                           f"queries {a['queries']} / {b['queries']}"))
    print_table(f"P2 desk pages, {small:,} vs {large:,} operations ({small:,} unresolved), "
                f"median of {rounds}", rows)
    desk = [summary_pages[n]["ratio"] for n in ("queue", "queue, manual_review",
                                                "operation detail")]
    summary = {
        "scale": args.scale, "small_rows": small, "large_rows": large,
        "ratio": max(desk),
        "queries_constant": all(p["small"]["queries"] == p["large"]["queries"]
                                == p["small"]["queries_again"]
                                for p in summary_pages.values()),
        "pages": summary_pages,
    }
    print(f"worst desk page ratio {summary['ratio']:.2f}x; query counts constant: "
          f"{summary['queries_constant']}")
    record("P2", summary)
    return summary


if __name__ == "__main__":
    main()
