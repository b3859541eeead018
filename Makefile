# Agent Ledger: `make demo` and `make test` do all the set-up on a fresh machine.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.12 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
PORT ?= 8000
STAMP := $(VENV)/.installed

.PHONY: demo demo-reset test test-pooler test-ha ha-up ha-down test-ts docs docs-serve screenshots install migrate roles lint bench serve db-stop clean

$(PY):
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 12), f"expected Python 3.12 or newer, found {sys.version.split()[0]} (set PYTHON=python3.12)"'
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml clients/python/pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]' -e clients/python
	@touch $(STAMP)

install: $(STAMP)

# Migrations (and db_roles) connect to the server directly, never through a pooler
# (LEDGER_POOLER_URL emptied): the processes of `make serve` connect through it.
DIRECT := LEDGER_POOLER_URL=
migrate: install
	$(DIRECT) $(PY) manage.py migrate --no-input

# The demo: seed, then the processes of Procfile.demo under honcho (the desk on runserver,
# the reconciler, the notifier, the sealer and the simulated articles service the
# reconciler reads). Ctrl-C stops them all; one of them dying stops the others and says so.
# The owner only migrates, seeds and runs db_roles; each process of Procfile.demo logs in
# as its own kind (docs/security.md): the desk and API as ledger_web, the reconciler,
# notifier and sealer as theirs.
demo: migrate
	LEDGER_DESK_URL=http://127.0.0.1:$(PORT) $(PY) manage.py demo_seed
	$(PY) manage.py db_roles $(LOGINS)
	LEDGER_DESK_URL=http://127.0.0.1:$(PORT) PYTHONUNBUFFERED=1 \
		$(VENV)/bin/honcho start -f Procfile.demo -p $(PORT)

# The demo's data as `make demo` first made it: drops the demo database, migrates, seeds.
demo-reset: install
	LEDGER_DESK_URL=http://127.0.0.1:$(PORT) $(PY) manage.py demo_seed --reset
	$(PY) manage.py db_roles $(LOGINS)

# The roles per kind of actor and one login per process (docs/security.md), as the owner.
LOGINS := --login ledger_web=agent,desk --login ledger_reconcile=reconciler \
	--login ledger_notify=reconciler --login ledger_seal=reconciler
roles: migrate
	$(PY) manage.py db_roles $(LOGINS)

# Every process of a deployment (Procfile: web, reconcile, notify, seal), after migrations
# and static files, under honcho: one process exiting stops the others, and honcho says
# which one and with what code. The web process binds PORT (honcho's base port).
# On the embedded server (no DATABASE_URL) the owner runs db_roles with one login per
# process and each process logs in as its own kind, as `make demo`'s do; with DATABASE_URL
# the logins are the deployment's (per-process DATABASE_URL or LEDGER_DATABASE_USER).
SERVE_LOGINS := LEDGER_WEB_LOGIN=ledger_web LEDGER_RECONCILE_LOGIN=ledger_reconcile \
	LEDGER_NOTIFY_LOGIN=ledger_notify LEDGER_SEAL_LOGIN=ledger_seal
# Behind a transaction-pooling PgBouncer: `make serve LEDGER_POOLER_URL=postgres://...` (its
# address; docs/SCALING.md, deploy/ha/pgbouncer.ini): every process connects through it.
serve: migrate
	$(DIRECT) $(PY) manage.py collectstatic --no-input --verbosity 0
	$(if $(DATABASE_URL),,$(DIRECT) $(PY) manage.py db_roles $(LOGINS))
	$(if $(DATABASE_URL),,$(SERVE_LOGINS)) PYTHONUNBUFFERED=1 \
		$(VENV)/bin/honcho start -f Procfile -p $(PORT)

# The documentation site, offline and strict (a broken link or anchor fails), into site/.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# The site built, then served on http://127.0.0.1:$(DOCS_PORT) (Ctrl-C stops it). Opened from
# files (site/index.html) every page reads, but the search cannot load its index: browsers
# refuse file:// fetches.
DOCS_PORT ?= 8001
docs-serve: docs
	@echo "the documentation on http://127.0.0.1:$(DOCS_PORT)/"
	$(PY) -m http.server $(DOCS_PORT) --bind 127.0.0.1 --directory site

# The desk's screenshots on the docs site, taken again of the real desk in Chromium.
screenshots: install
	LEDGER_UPDATE_SCREENSHOTS=1 $(PY) -m pytest -q tests/e2e/test_docs_screenshots.py

# Migrations first: a model, or the transition table behind the operations trigger
# (ledger/states.py), changed without its migration fails here (and the embedded server is
# started, before any worker needs it). The documentation site is built strictly by the
# suite itself (tests/test_docs.py). Then the suite in two parts: all but the
# server-dependent tests on TEST_WORKERS workers (pytest-xdist; each worker has a test
# database of its own, a test file stays on one worker), then the server-dependent ones
# alone (tests/conftest.py's SERVER_DEPENDENT: they create and alter the server's roles,
# which every database's logins share). A part that PYTEST_ARGS leaves empty (pytest's
# exit status 5) is not a failure; both empty is.
TEST_WORKERS ?= 2
test: install
	$(PY) manage.py makemigrations --check --dry-run
	@echo "== the suite but the server-dependent tests, on $(TEST_WORKERS) workers"
	@$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --server-tests=without $(PYTEST_ARGS); \
	rest=$$?; echo "== the server-dependent tests, alone"; \
	$(PY) -m pytest --server-tests=only $(PYTEST_ARGS); server=$$?; \
	if [ $$rest -eq 5 ] && [ $$server -eq 5 ]; then exit 5; fi; \
	for status in $$rest $$server; do \
		if [ $$status -ne 0 ] && [ $$status -ne 5 ]; then exit $$status; fi; done

# The process tests that matter behind a real PgBouncer in transaction mode (Debian's
# pgbouncer, started on a loopback port for the session: tests/ha/pooler.py): every child
# process and test server connects through it. Skipped, and said so, without pgbouncer.
POOLER_TESTS := tests/api/test_web_roles.py tests/ledger/test_role_refusals.py \
	tests/ledger/test_trust_who.py tests/ledger/test_fence.py tests/api/test_concurrency.py \
	tests/api/test_mcp.py
test-pooler: install
	@if [ -x /usr/sbin/pgbouncer ] || command -v pgbouncer >/dev/null 2>&1; then \
		LEDGER_TEST_POOLER=1 $(PY) -m pytest -q $(POOLER_TESTS) $(PYTEST_ARGS); \
	else echo "!! pgbouncer not found (apt-get install pgbouncer): skipped make test-pooler"; fi

# A PostgreSQL primary and a synchronous standby under Patroni with etcd (Debian's patroni,
# etcd-server and postgresql-15), data and logs under .local/ha (deploy/ha/cluster.py).
ha-up: install
	$(PY) deploy/ha/cluster.py up
ha-down: install
	$(PY) deploy/ha/cluster.py down

# The failover under load: bench/load.py's deployment (gunicorn, 2 reconcilers with their
# sealers, agents in process and over HTTP, the simulated service) on a cluster of its own
# (.local/ha-test, made afresh and removed after; `make ha-up`'s ports, so not while that
# one runs) through the multi-host URL; its primary SIGKILLed (Patroni and PostgreSQL) 6 s
# in; then the invariants (no acknowledged receipt lost, no article twice, every operation resolved,
# verify_audit clean, no 500), the failover seconds and the errors agents saw. Bounded
# (about 2 minutes); skipped, and said so, without the packages.
HA_ARGS ?= --seconds 20 --agents 6 --reviewers 0 --web-workers 2 --drain 45 \
	--kill-primary-after 6
test-ha: install
	@if $(PY) -c 'import sys; sys.path.insert(0, "deploy/ha"); import cluster; \
		sys.exit(1 if cluster.missing() else 0)'; then \
		export LEDGER_HA_DIR=$(CURDIR)/.local/ha-test; \
		$(PY) deploy/ha/cluster.py down --wipe >/dev/null; \
		$(PY) deploy/ha/cluster.py up && \
		DATABASE_URL="$$($(PY) deploy/ha/cluster.py url)" LEDGER_POOLER_URL= \
		LEDGER_BENCH_DATABASE=ledger_ha_load LEDGER_STALE_SUBMISSION_SECONDS=20 \
		LEDGER_IN_FLIGHT_SECONDS=10 \
		$(PY) bench/load.py $(HA_ARGS) --summary $(CURDIR)/.local/ha-failover.json; \
		status=$$?; $(PY) deploy/ha/cluster.py down --wipe; exit $$status; \
	else echo "!! patroni, etcd or PostgreSQL 15 not installed (apt-get install patroni \
	etcd-server postgresql-15): skipped make test-ha"; fi

# The TypeScript client (clients/typescript): `npm ci` (no dependencies: offline) and its
# tests under node's test runner against a real server of this tree, on a database of their
# own (DATABASE_URL's server, else the embedded one). Skipped, and said so, without node.
test-ts: install
	@if command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1; then \
		(cd examples/typescript/ai-sdk && npm ci --no-audit --no-fund --prefer-offline >/dev/null) \
		|| echo "!! could not install the Vercel AI SDK example's dependencies: its test is skipped"; \
		cd clients/typescript && npm ci --no-audit --no-fund --offline \
		&& LEDGER_PYTHON=$(abspath $(PY)) npm test; \
	else echo "!! node/npm not found: skipped the TypeScript client's tests (clients/typescript)"; fi

lint: install
	$(VENV)/bin/ruff check .

bench: migrate
	$(PY) bench/run_all.py --scale quick

db-stop: install
	$(PY) -c 'from pathlib import Path; from config.embedded import stop; print("stopped" if stop(Path.cwd()) else "not running")'

clean:
	rm -rf $(VENV) .local site

.PHONY: install-prod dist

# A server's install (docs/operations.md): the project into $(VENV) without the development
# extras (no pytest, playwright, langgraph, openai-agents, schemathesis, mkdocs, honcho);
# `make install-prod VENV=/srv/agent-ledger/.venv`. Building leaves no build/ folder.
install-prod: | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet .

# What a release attaches (docs/agents/client.md): the project's wheel, the Python client's
# wheel and the TypeScript client's tarball, into dist/ (or DIST=/absolute/path).
DIST ?= dist
dist: | $(PY)
	rm -rf $(DIST) && mkdir -p $(DIST)
	$(PY) -m pip wheel --quiet --no-deps --wheel-dir $(DIST) . ./clients/python
	cd clients/typescript && npm pack --silent --pack-destination $(abspath $(DIST)) >/dev/null
	@ls -1 $(DIST)
