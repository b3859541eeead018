"""Demo data for `manage.py demo_seed`, one module per area."""
