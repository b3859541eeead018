import pytest

from tests.factories import UserFactory


@pytest.fixture
def other_tenant_reviewer(db):
    """A reviewer who may see tenant "acme" only."""
    return UserFactory(username="acme-reviewer", role="reviewer", tenants=["acme"])
