"""MkDocs hook: the reference pages, generated from the code at every build.

`mkdocs build` (`make docs`) imports this file (mkdocs.yml, `hooks:`). It sets Django up
without connecting to any database, then writes four pages that are never edited by hand:

- reference/settings.md      every LEDGER_* setting of ledger/conf.py, default and meaning
- reference/http-api.md      every route of the OpenAPI document (/api/v1/openapi.json),
                             and the document itself as reference/openapi.json
- reference/errors.md        the ledger's errors (ledger/errors.py), the problem type each
                             becomes (api/problems.py), and the other problem types the
                             network surfaces send
- reference/commands.md      the help of every management command of the project's apps

It also shows CHANGELOG.md as changelog.md, and puts the published benchmark runs
(bench/results/published-*.json) into the performance page's table.
Nothing here reaches the network.
"""

from __future__ import annotations

import io
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent

# Apps whose management commands the reference lists (Django's own are documented by Django).
COMMAND_APPS = ("ledger", "api", "demo", "review")


def _setup_django() -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    # Settings need a database *named*; nothing here connects to it (without this the
    # settings would start the embedded PostgreSQL).
    os.environ.setdefault("DATABASE_URL", "postgres://docs@127.0.0.1:1/docs-build")
    import django

    django.setup()


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def settings_page() -> str:
    from ledger import conf

    lines = [
        "# Settings",
        "",
        "Generated from `ledger/conf.py` at build time. Every setting is optional: a project",
        "sets `LEDGER_<NAME>` in its Django settings only to change the default, and",
        "`manage.py check` names a value of the wrong kind. This project's",
        "`config/settings.py` also reads several of them from environment variables of the",
        "same name (see the [runbook](../operations.md#environment)).",
        "",
        "| setting | default | kind | what it does |",
        "|---|---|---|---|",
    ]
    for name, setting in conf.SETTINGS.items():
        default = setting.default
        shown = "`{}`" if default in ({}, ()) else f"`{default!r}`"
        if default in ({}, ()):
            shown = "none"
        lines.append(f"| `LEDGER_{name}` | {shown} | {setting.kind} | {_cell(setting.doc)} |")
    return "\n".join(lines) + "\n"


def openapi_document() -> dict:
    from api.http import api

    return api.get_openapi_schema(path_prefix="/api/v1")


def _schema_name(schema: dict) -> str:
    """A schema in a few words; a named one links to its table under "Schemas"."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[`{name}`](#{name.lower()})"
    if schema.get("type") == "array":
        return f"list of {_schema_name(schema.get('items', {}))}"
    if "anyOf" in schema:
        return " or ".join(_schema_name(s) for s in schema["anyOf"])
    return f"`{schema.get('type', 'object')}`"


def http_api_page(document: dict) -> str:
    lines = [
        "# HTTP API reference",
        "",
        "Generated at build time from the OpenAPI document the server serves at",
        "`/api/v1/openapi.json` ([a copy](openapi.json)). Every route takes",
        "`Authorization: Bearer <agent key>`; every error is `application/problem+json`",
        "([problem types](errors.md)). How to use it: [HTTP API](../agents/http.md).",
        "",
    ]
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            lines += [f"## `{method.upper()} {path}`", ""]
            summary = operation.get("summary") or operation.get("operationId", "")
            if summary:
                lines += [summary, ""]
            if operation.get("description"):
                lines += [operation["description"].strip(), ""]
            params = operation.get("parameters", [])
            if params:
                lines += ["| parameter | in | type | required |", "|---|---|---|---|"]
                for p in params:
                    kind = _schema_name(p.get("schema", {}))
                    lines.append(f"| `{p['name']}` | {p['in']} | {_cell(kind)} | "
                                 f"{'yes' if p.get('required') else 'no'} |")
                lines.append("")
            body = operation.get("requestBody", {}).get("content", {})
            for media, content in body.items():
                lines += [f"Body ({media}): {_schema_name(content.get('schema', {}))}", ""]
            responses = operation.get("responses", {})
            if responses:
                lines += ["| status | answer |", "|---|---|"]
                for status, response in responses.items():
                    content = response.get("content", {})
                    what = ", ".join(f"{_schema_name(c.get('schema', {}))} ({media})"
                                     for media, c in content.items())
                    lines.append(f"| {status} | {_cell(response.get('description', ''))}"
                                 f"{': ' + what if what else ''} |")
                lines.append("")
    schemas = document.get("components", {}).get("schemas", {})
    if schemas:
        lines += ["## Schemas", ""]
        for name, schema in schemas.items():
            lines += [f"### `{name}`", ""]
            required = set(schema.get("required", []))
            props = schema.get("properties", {})
            if props:
                lines += ["| field | type | required |", "|---|---|---|"]
                for field, spec in props.items():
                    lines.append(f"| `{field}` | {_cell(_schema_name(spec))} | "
                                 f"{'yes' if field in required else 'no'} |")
                lines.append("")
    return "\n".join(lines) + "\n"


# problems.problem(<status>, "<slug>", "<title>", ...) written out in the transport code
_PROBLEM_CALL = re.compile(r'problems\.problem\(\s*(\d+),\s*"([a-z-]+)",\s*"([^"]+)"')


def errors_page() -> str:
    import inspect

    from api import problems
    from ledger import errors

    lines = [
        "# Errors and problem types",
        "",
        "Generated at build time from `ledger/errors.py` and `api/problems.py`. In Python",
        "every refusal is a `ledger.errors.LedgerError` whose message says what was expected",
        "and what was found; over HTTP it is an `application/problem+json` answer (RFC 9457)",
        "whose `type` is the URN below and whose `detail` is the same message; over MCP a",
        "tool error quoting it.",
        "",
        "## The ledger's errors",
        "",
        "| error | problem type | status | when |",
        "|---|---|---|---|",
    ]
    seen = set()
    for _name, cls in inspect.getmembers(errors, inspect.isclass):
        if not issubclass(cls, errors.LedgerError) or cls.__module__ != errors.__name__:
            continue
        seen.add(cls)
        status, slug = next((status, slug) for kind, status, slug, _title in problems.KINDS
                            if issubclass(cls, kind))
        doc = " ".join((cls.__doc__ or "").split())
        lines.append(f"| `{cls.__name__}` | `{problems.type_uri(slug)}` | {status} | "
                     f"{_cell(doc)} |")
    lines += [
        "",
        "## Problem types of the network surfaces",
        "",
        "Sent before the ledger is reached (authentication, the request's shape, routing).",
        "",
        "| problem type | status | title | sent by |",
        "|---|---|---|---|",
    ]
    found: dict[tuple[str, int], tuple[str, set[str]]] = {}
    for path in sorted([*ROOT.glob("api/*.py"), *ROOT.glob("config/*.py")]):
        for status, slug, title in _PROBLEM_CALL.findall(path.read_text()):
            entry = found.setdefault((slug, int(status)), (title, set()))
            entry[1].add(str(path.relative_to(ROOT)))
    for (slug, status), (title, where) in sorted(found.items()):
        lines.append(f"| `{problems.type_uri(slug)}` | {status} | {title} | "
                     f"{', '.join(f'`{w}`' for w in sorted(where))} |")
    return "\n".join(lines) + "\n"


def commands_page() -> str:
    from django.core.management import get_commands, load_command_class

    lines = [
        "# Management commands",
        "",
        "Generated at build time from each command's own `--help`. Run them as",
        "`.venv/bin/python manage.py <command>`; Django's own commands (`migrate`,",
        "`createsuperuser`, ...) are documented by Django.",
        "",
    ]
    for name, app in sorted(get_commands().items()):
        if app.split(".")[-1] not in COMMAND_APPS:
            continue
        command = load_command_class(app, name)
        parser = command.create_parser("manage.py", name)
        out = io.StringIO()
        parser.print_help(out)
        text = re.sub(r"\n\s*--version.*?(?=\n  -|\n\n|\Z)", "", out.getvalue(), flags=re.S)
        lines += [f"## `{name}`", "", f"From `{app}`.", "", "```text", text.rstrip(), "```", ""]
    return "\n".join(lines) + "\n"


def performance_table() -> str:
    """The published runs of bench/run_all.py (bench/results/published-<scale>.json: the
    run's latest.json with a `note` saying where it ran), one column per scale."""
    runs, notes = {}, {}
    for path in sorted((ROOT / "bench" / "results").glob("published-*.json")):
        scale = path.stem.removeprefix("published-")
        recorded = json.loads(path.read_text())
        notes[scale] = recorded.pop("note", "")
        runs[scale] = recorded
    if not runs:
        return "*No published run in bench/results/published-*.json.*\n"
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench.run_all import GOALS

    scales = sorted(runs, key=lambda s: (s != "quick", s))
    lines = ["| | what the ratio compares | " + " | ".join(scales) + " | goal |",
             "|---|---|" + "---|" * len(scales) + "---|"]
    for name, (what, goal, sense) in GOALS.items():
        cells = []
        for scale in scales:
            result = runs[scale].get(name)
            cells.append(f"{result['ratio']:.2f}×" if result else "not run")
        goal_text = (f"{'≤' if sense == '<=' else '≥'} {goal}×" if goal is not None
                     else "report")
        lines.append(f"| {name} | {what} | " + " | ".join(cells) + f" | {goal_text} |")
    lines.append("")
    for scale in scales:
        dates = sorted(r.get("recorded_at", "") for r in runs[scale].values())
        when = f"{dates[0][:10]} to {dates[-1][:10]}" if dates[0][:10] != dates[-1][:10] \
            else dates[-1][:10]
        lines.append(f"- **{scale}** (`bench/results/published-{scale}.json`, recorded "
                     f"{when}): {notes[scale]}")
    return "\n".join(lines) + "\n"


# --- MkDocs events ------------------------------------------------------------------------

def on_files(files, config):
    from mkdocs.structure.files import File

    _setup_django()
    document = openapi_document()
    pages = {
        "reference/settings.md": settings_page(),
        "reference/http-api.md": http_api_page(document),
        "reference/errors.md": errors_page(),
        "reference/commands.md": commands_page(),
        "reference/openapi.json": json.dumps(document, indent=2, sort_keys=True),
        # the changelog lives at the top of the project; the site shows the same file
        "changelog.md": (ROOT / "CHANGELOG.md").read_text(),
    }
    for uri, content in pages.items():
        existing = files.get_file_from_path(uri)
        if existing is not None:
            files.remove(existing)
        files.append(File.generated(config, uri, content=content))
    return files


def on_page_markdown(markdown, page, config, files):
    if "<!-- bench-table -->" in markdown:
        markdown = markdown.replace("<!-- bench-table -->", performance_table())
    return markdown
