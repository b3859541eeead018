"""The documentation site builds offline and strictly, with its reference pages generated
from the code, and loads nothing from another origin."""

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.support.processes import ROOT


def page_text(site: Path, uri: str) -> str:
    return (site / uri).read_text()


def test_every_page_of_the_nav_is_built(site):
    nav = Path(ROOT, "mkdocs.yml").read_text()
    for source in re.findall(r":\s+([\w/.-]+\.md)\s*$", nav, re.M):
        built = site / source.replace(".md", ".html")
        assert built.exists(), f"expected {built} from {source}, found none"


def test_the_settings_reference_lists_every_ledger_setting(site):
    from ledger import conf

    text = page_text(site, "reference/settings.html")
    for name, setting in conf.SETTINGS.items():
        assert f"LEDGER_{name}" in text
        assert setting.kind in text


def test_the_http_reference_is_the_openapi_document_the_server_serves(site, client):
    served = client.get("/api/v1/openapi.json").json()
    copied = json.loads(page_text(site, "reference/openapi.json"))
    assert copied["paths"].keys() == served["paths"].keys()
    text = page_text(site, "reference/http-api.html")
    for path, methods in served["paths"].items():
        for method in methods:
            assert f"{method.upper()} {path}" in text


def test_the_errors_reference_names_every_ledger_error_and_its_problem_type(site):
    from api import problems
    from ledger import errors

    text = page_text(site, "reference/errors.html")
    for cls in vars(errors).values():
        if isinstance(cls, type) and issubclass(cls, errors.LedgerError):
            assert f"<code>{cls.__name__}</code>" in text
    for _cls, _status, slug, _title in problems.KINDS:
        assert problems.type_uri(slug) in text
    for slug in ("unauthenticated", "invalid-request", "malformed-body", "internal-error"):
        assert problems.type_uri(slug) in text


def test_the_commands_reference_has_the_help_of_every_command(site):
    text = page_text(site, "reference/commands.html")
    for name in ("reconcile", "notify", "seal", "purge", "verify_audit", "agent_key", "mcp",
                 "demo_seed", "demo_articles"):
        assert f'id="{name}"' in text or f"<code>{name}</code>" in text, name
    assert "--interval" in text and "--batch-target-ms" in text


def test_the_performance_page_has_the_recorded_ratios(site):
    text = page_text(site, "performance.html")
    recorded = json.loads(Path(ROOT, "bench/results/published-quick.json").read_text())
    assert recorded.pop("note")
    for name, result in recorded.items():
        assert f"{result['ratio']:.2f}×" in text, name


def test_nothing_is_loaded_from_another_origin(site):
    remote = re.compile(r"""<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)=["']?(?:https?:)?//""")
    for page in site.rglob("*.html"):
        found = remote.search(page.read_text())
        assert found is None, f"expected only local assets in {page}, found {found.group(0)}"
    css = "".join(p.read_text() for p in site.rglob("*.css"))
    assert "fonts.googleapis" not in css and "@import url(http" not in css


def test_a_broken_link_fails_the_build(tmp_path):
    """Strict means strict: a page linking to a page that does not exist stops the build."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[gone](missing.md)\n")
    (tmp_path / "mkdocs.yml").write_text(
        Path(ROOT, "mkdocs.yml").read_text().split("\nhooks:")[0] + "\nnav:\n  - index.md\n")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "missing.md" in done.stderr


# --- pages that name the code: every name they cite exists -----------------------------------

# What the code is made of: where a name the docs cite must be found.
CODE_DIRS = ("ledger", "api", "config", "review", "clients/python", "clients/typescript/src")
CODE_SUFFIXES = {".py", ".js", ".sql"}
# A code identifier in backticks: snake_case, CamelCase or dotted, with "()" allowed after it;
# plain words (`planned`, `agent`) and anything with a space, a slash or a quote are prose.
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _code_text() -> str:
    parts = []
    for top in CODE_DIRS:
        for path in sorted(Path(ROOT, top).rglob("*")):
            if path.suffix in CODE_SUFFIXES and "node_modules" not in path.parts:
                parts.append(path.read_text(errors="replace"))
    return "\n".join(parts)


def cited_identifiers(markdown: str) -> set[str]:
    """The names in backticks (code blocks left out) that look like code identifiers."""
    prose = re.sub(r"```.*?```", "", markdown, flags=re.S)
    found = set()
    for span in re.findall(r"`([^`\n]+)`", prose):
        name = span.removesuffix("()")
        if not IDENTIFIER.fullmatch(name):
            continue
        if "_" in name or "." in name or re.search(r"[a-z][A-Z]", name):
            found.add(name)
    return found


def missing_from_code(names: set[str], code: str) -> list[str]:
    """The names of which some part (split at the dots) is not a whole word of the code."""
    return sorted(name for name in names
                  if not all(re.search(rf"(?<![\w]){re.escape(part)}(?![\w])", code)
                             for part in name.split(".")))


def test_the_write_path_page_names_only_what_exists_in_the_code():
    page = Path(ROOT, "docs", "write-path.md").read_text()
    names = cited_identifiers(page)
    # The page is a walk through the code: it names its functions, triggers and SQL.
    assert {"record_intent", "transitions.by_agent", "CHANGE_OPERATION", "event_chain_columns",
            "event_fenced", "ledger_seal_events", "AgentKeyAuth.authenticate",
            "service.record_intent"} <= names
    assert missing_from_code(names, _code_text()) == []


def test_the_name_check_finds_a_name_the_code_lacks():
    code = "def record_intent(): ...\nCHANGE_OPERATION = 1\n"
    assert missing_from_code({"record_intent", "receipts.record_intnet", "CHANGE_OPERATION"},
                             code) == ["receipts.record_intnet"]
    assert cited_identifiers("`a_b` `planned` `x y` `f()`\n```\n`in_code`\n```") == {"a_b"}


def test_the_security_model_lists_each_role_s_writes_as_db_roles_grants_them():
    from ledger import db_roles

    page = Path(ROOT, "docs", "security-model.md").read_text()
    section = page.split("## What each role may write", 1)[1].split("\n## ", 1)[0]
    functions = {name.split("(")[0]: kinds for name, kinds in db_roles.FUNCTIONS.items()}
    for kind, role in db_roles.ROLE.items():
        row = next(line for line in section.splitlines() if line.startswith(f"| `{role}`"))
        may_write = row.split(" | ")[1]
        named = set(re.findall(r"`(ledger_\w+)`", may_write))
        assert named & set(db_roles.LEDGER_WRITES) == {
            table for table, writers in db_roles.LEDGER_WRITES.items() if kind in writers}, role
        assert named & set(functions) == {
            name for name, kinds in functions.items() if kind in kinds}, role
        assert named <= set(db_roles.LEDGER_WRITES) | set(functions), role
    assert missing_from_code(cited_identifiers(section), _code_text()) == []
