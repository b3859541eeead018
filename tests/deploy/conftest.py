"""Tests of a deployment as the runbook (docs/operations.md) makes it."""
