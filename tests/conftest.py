import pytest

from tests.factories import OperationFactory, UserFactory


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
