# Agent Ledger: `make demo` and `make test` do all the set-up on a fresh machine.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.12 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
PORT ?= 8000
STAMP := $(VENV)/.installed

.PHONY: demo test install migrate lint bench serve db-stop clean

$(PY):
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 12), f"expected Python 3.12 or newer, found {sys.version.split()[0]} (set PYTHON=python3.12)"'
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

migrate: install
	$(PY) manage.py migrate --no-input

# The notification loop runs beside the server (its deliveries go to the demo's catcher at
# /demo/webhook-catcher/) and is stopped when the server stops.
demo: migrate
	LEDGER_DESK_URL=http://127.0.0.1:$(PORT) $(PY) manage.py demo_seed
	(sleep 3; LEDGER_DESK_URL=http://127.0.0.1:$(PORT) exec $(PY) manage.py notify --interval 5) & \
	notify_pid=$$!; $(PY) manage.py seal --interval 1 >/dev/null & seal_pid=$$!; \
	trap 'kill $$notify_pid $$seal_pid 2>/dev/null; wait $$notify_pid $$seal_pid 2>/dev/null' EXIT; \
	$(PY) manage.py runserver 127.0.0.1:$(PORT)

# Production-style serving: migrations, static files, then gunicorn (config/gunicorn.conf.py)
# with uvicorn workers on config.asgi. Bind address: PORT / GUNICORN_BIND.
serve: migrate
	$(PY) manage.py collectstatic --no-input --verbosity 0
	PORT=$(PORT) $(VENV)/bin/gunicorn -c config/gunicorn.conf.py config.asgi:application

# Migrations first: a model, or the transition table behind the operations trigger
# (ledger/states.py), changed without its migration fails here.
test: install
	$(PY) manage.py makemigrations --check --dry-run
	$(PY) -m pytest $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .

bench: migrate
	$(PY) bench/run_all.py --scale quick

db-stop: install
	$(PY) -c 'from pathlib import Path; from config.embedded import stop; print("stopped" if stop(Path.cwd()) else "not running")'

clean:
	rm -rf $(VENV) .local
