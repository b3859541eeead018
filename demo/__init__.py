"""The project's demo, outside the reusable `ledger` and `review` apps.

`manage.py demo_seed` (demo/management/commands/) seeds one module per area
(`demo.operations`, `demo.execution`); `demo.simulated` holds the simulated articles
service, its client and reconciler, and a simulated agent, used by the demo, the tests and
`LEDGER_RECONCILER_MODULES` in config/settings.py.
"""
