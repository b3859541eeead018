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
