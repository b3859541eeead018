"""Simulated external systems (and agents) for tests and the demo. 127.0.0.1 only."""
