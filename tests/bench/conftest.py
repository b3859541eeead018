# The API's real server and agent keys (tests/api/conftest.py), for the load test's HTTP agent.
from tests.api.conftest import admin, api_server, make_key  # noqa: F401
