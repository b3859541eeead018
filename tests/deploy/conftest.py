"""Tests of a deployment as the runbook (docs/operations.md) makes it."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: installs into a fresh venv from the package index (minutes, "
                   "bounded by timeouts); deselect with -m 'not slow'")
