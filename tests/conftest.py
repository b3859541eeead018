import pytest
from django.db import connections, transaction
from django.test import TransactionTestCase

from tests.factories import OperationFactory, UserFactory

# Tests whose outcome depends on which PostgreSQL server runs them and how the suite logs in
# to it (the embedded server's bootstrap, DATABASE_URL, the roles and logins db_roles makes,
# refusals as each role): CI runs the whole suite on the embedded server, then these again
# on the machine's server (`pytest -m server`).
SERVER_DEPENDENT = {
    "tests/api/test_request_id_roles.py",
    "tests/api/test_web_roles.py",
    "tests/ha/test_lost_answer.py",
    "tests/ha/test_pooler.py",
    "tests/ledger/test_app_role_attacks.py",
    "tests/ledger/test_automatic_retry_check.py",
    "tests/ledger/test_chain_trust.py",
    "tests/ledger/test_coverage.py",
    "tests/ledger/test_coverage_retention.py",
    "tests/ledger/test_db_roles.py",
    "tests/ledger/test_event_tenant.py",
    "tests/ledger/test_fact_expiry.py",
    "tests/ledger/test_fact_links_tenant.py",
    "tests/ledger/test_fence_rows_added.py",
    "tests/ledger/test_operation_search.py",
    "tests/ledger/test_outcome_policy_roles.py",
    "tests/ledger/test_provider_account.py",
    "tests/ledger/test_rls_tenants.py",
    "tests/ledger/test_role_refusals.py",
    "tests/ledger/test_trust_leases_approvals.py",
    "tests/ledger/test_trust_who.py",
    "tests/review/test_fact_correction.py",
    "tests/test_database_setup.py",
    "tests/test_serve.py",
    "tests/test_settings.py",
}


def pytest_addoption(parser):
    parser.addoption(
        "--server-tests", choices=("with", "without", "only"), default="with",
        help="with (default), without or only the server-dependent tests (SERVER_DEPENDENT). "
             "`make test` runs the rest on parallel workers (pytest-xdist), then these alone: "
             "they create and alter the server's roles, which every worker's logins share.")


def pytest_collection_modifyitems(config, items):
    root = config.rootpath
    keep = config.getoption("server_tests")
    selected, deselected = [], []
    for item in items:
        server = item.path.relative_to(root).as_posix() in SERVER_DEPENDENT
        if server:
            item.add_marker(pytest.mark.server)
        (selected if keep == "with" or server == (keep == "only") else deselected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


@pytest.fixture(scope="session")
def site(tmp_path_factory):
    """The documentation site built offline and strictly, once for the session: the docs
    tests read its files (tests/test_docs.py), the browser opens them
    (tests/e2e/test_docs_site.py)."""
    import os
    import subprocess
    import sys

    from tests.support.processes import ROOT

    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True,
        text=True, timeout=300,
    )
    assert done.returncode == 0, f"expected a strict build, found:\n{done.stderr[-4000:]}"
    return out


@pytest.fixture
def make_op(db):
    """make_op(state="outcome_unknown", **record_intent kwargs) -> Operation via the API."""
    return OperationFactory


@pytest.fixture
def viewer(db):
    return UserFactory(username="viewer", role="viewer")


@pytest.fixture
def reviewer(db):
    return UserFactory(username="reviewer", role="reviewer")


@pytest.fixture
def admin_user(db):
    return UserFactory(username="admin", role="admin")


# The roles per kind of actor and one login per kind on the test database, on the embedded
# server and on a DATABASE_URL server alike (its login is the owner, often a superuser):
# tests that run a child process as one kind log in as these (tests/support/processes.py).
TEST_LOGINS = {"agent": "ledger_test_agent", "reconciler": "ledger_test_reconciler",
               "desk": "ledger_test_desk", "web": "ledger_test_web"}
# The logins Procfile.demo's processes use (the Makefile's `roles`): tests/test_demo.py runs
# them as they are.
DEMO_LOGINS = [("ledger_web", ("agent", "desk")), ("ledger_reconcile", ("reconciler",)),
               ("ledger_notify", ("reconciler",)), ("ledger_seal", ("reconciler",))]


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup, django_db_blocker):
    from ledger import db_roles

    with django_db_blocker.unblock():
        db_roles.apply(logins=[(TEST_LOGINS[kind], (kind,)) for kind in db_roles.KINDS]
                       + [(TEST_LOGINS["web"], (db_roles.AGENT, db_roles.DESK))]
                       + DEMO_LOGINS)
        _BOOTSTRAP.update(_bootstrap_rows())
    pooler = _session_pooler()
    yield
    if pooler is not None:
        pooler.stop()  # before the test database is dropped: it holds server connections


def _session_pooler():
    """LEDGER_TEST_POOLER=1 (`make test-pooler`): a PgBouncer in transaction mode in front of
    the test database, which every child process and test server of the session connects
    through (LEDGER_POOLER_URL, inherited); this process stays direct (tests/ha/pooler.py)."""
    import os

    from django.db import connection

    from tests.ha.pooler import PgBouncer, available

    if os.environ.get("LEDGER_TEST_POOLER") != "1":
        return None
    if not available():
        pytest.exit("expected pgbouncer (Debian's package) for LEDGER_TEST_POOLER=1, "
                    "found none", returncode=2)
    settings = connection.settings_dict
    owner = settings["USER"] or "postgres"
    pooler = PgBouncer(settings["HOST"], settings["PORT"],
                       [owner, *TEST_LOGINS.values(), *(name for name, _ in DEMO_LOGINS)]).start()
    os.environ["LEDGER_POOLER_URL"] = pooler.url(settings["NAME"], owner)
    return pooler


# What migrate's post_migrate receivers left in the test database (content types,
# permissions, the role groups, the default retention policies), by table, read once after
# set-up. Django's teardown of a transactional test truncates all 70-odd tables and runs
# post_migrate again: 1.5-2.5 s a test on this suite's machine, for a few hundred tests.
# `_flush_keeping_bootstrap` truncates only the tables a test wrote (CASCADE brings the
# tables that reference them) and puts back the set-up rows that were lost, ids included.
_BOOTSTRAP: dict[str, tuple[str, str]] = {}  # table -> (rows as JSON, digest of the rows)


def _digest_sql(quoted: str) -> str:
    return f"(SELECT md5(coalesce(string_agg(t::text, ',' ORDER BY t::text), '')) FROM {quoted} t)"


def _tables(connection) -> list[str]:
    return sorted(connection.introspection.django_table_names(only_existing=True,
                                                              include_views=False))


def _bootstrap_rows(using: str = "default") -> dict[str, tuple[str, str]]:
    connection = connections[using]
    rows = {}
    with connection.cursor() as cursor:
        for table in _tables(connection):
            quoted = connection.ops.quote_name(table)
            cursor.execute(f"SELECT (SELECT jsonb_agg(t)::text FROM {quoted} t), "
                           f"{_digest_sql(quoted)}")
            text, digest = cursor.fetchone()
            if text is not None:
                rows[table] = (text, digest)
    return rows


def _flush_keeping_bootstrap(self) -> None:
    """TransactionTestCase's teardown (replaces Django's flush + post_migrate): empties every
    table a test left rows in and restores the set-up rows (see _BOOTSTRAP)."""
    for using in self._databases_names(include_mirrors=False):
        connection = connections[using]
        quote = connection.ops.quote_name
        tables = _tables(connection)
        probes = [f"{_digest_sql(quote(t))} <> %s" if t in _BOOTSTRAP
                  else f"EXISTS (SELECT 1 FROM {quote(t)})" for t in tables]
        params = [_BOOTSTRAP[t][1] for t in tables if t in _BOOTSTRAP]
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT ARRAY[{', '.join(probes)}]", params)
            written = [t for t, dirty in zip(tables, cursor.fetchone()[0], strict=True) if dirty]
            if not written:
                continue
            with transaction.atomic(using=using):  # deferred foreign keys: any table order
                cursor.execute(f"TRUNCATE {', '.join(quote(t) for t in written)} CASCADE")
                for table, (text, digest) in _BOOTSTRAP.items():
                    cursor.execute(f"SELECT {_digest_sql(quote(table))} = %s", [digest])
                    if not cursor.fetchone()[0]:  # truncated, or by CASCADE
                        cursor.execute(f"INSERT INTO {quote(table)} SELECT * FROM "
                                       f"jsonb_populate_recordset(NULL::{quote(table)}, %s)",
                                       [text])


TransactionTestCase._fixture_teardown = _flush_keeping_bootstrap
