"""Demo data for `make demo`."""
