"""The code in the README and on the documentation site runs as written.

The README's decorator example runs twice and sends once; the site's agent example
(docs/agents/in-process.md) replays without sending; every other complete program on the
site (a block that calls `django.setup()`) runs in a child process against the test
database and exits 0; every Python block of the README and the site compiles.
"""

import re
from pathlib import Path

import pytest

from ledger.models import Operation
from tests.support.processes import ROOT, spawn

DOCS = Path(ROOT) / "docs"
PAGES = [Path(ROOT) / "README.md", *sorted(DOCS.rglob("*.md"))]


def python_blocks(text: str) -> list[str]:
    """The ```python blocks of a Markdown text, indented ones (in a list item) dedented."""
    blocks = []
    for indent, body in re.findall(r"^( *)```python\n(.*?)^\1```", text, re.S | re.M):
        blocks.append("\n".join(line[len(indent):] for line in body.splitlines()) + "\n")
    return blocks


def doc_block(page: str, heading: str, index: int = 0) -> str:
    """The `index`th Python block after `heading` in `page` (README.md or a docs/ path)."""
    text = (Path(ROOT) / page).read_text()
    assert heading in text, f"expected the heading {heading!r} in {page}, found none"
    return python_blocks(text.split(heading, 1)[1])[index]


def readme_block(heading: str, index: int = 0) -> str:
    return doc_block("README.md", heading, index)


def all_blocks() -> list[tuple[str, int, str]]:
    return [(str(page.relative_to(ROOT)), i, block)
            for page in PAGES for i, block in enumerate(python_blocks(page.read_text()))]


def programs() -> list[tuple[str, int, str]]:
    """Blocks that are whole programs: they set Django up themselves."""
    return [entry for entry in all_blocks() if "django.setup()" in entry[2]]


def run_twice(code: str) -> list[str]:
    outputs = []
    for _ in range(2):
        child = spawn(code)
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        outputs.append(out)
    return outputs


@pytest.mark.django_db(transaction=True)
def test_the_decorator_example_in_the_readme_sends_once_then_returns_the_stored_result():
    outputs = run_twice(readme_block("## Wrapping a call in process"))
    assert "sending hello-world" in outputs[0]
    assert "sending" not in outputs[1]
    assert "result {'id': 'article-7', 'slug': 'hello-world'}" in outputs[1]
    op = Operation.objects.get()
    assert (op.external_id, op.result) == ("article-7", {"id": "article-7", "slug": "hello-world"})


@pytest.mark.django_db(transaction=True)
def test_the_agent_example_on_the_site_runs_and_replays_without_sending():
    code = doc_block("docs/agents/in-process.md", "Without the decorator")
    outputs = run_twice(code)
    assert "succeeded article-42 {'Authorization': '[redacted]'}" in outputs[0]
    assert "already recorded, not sending again" in outputs[1]
    assert Operation.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_the_reconciler_example_on_the_site_settles_the_lost_answer_from_the_listing():
    child = spawn(doc_block("docs/reconcilers.md", "# Reconcilers"))
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    assert "succeeded msg-1@ada@example.com found" in out
    assert Operation.objects.get().state == "succeeded"


def test_the_pages_hold_the_programs_the_tests_above_check():
    found = {page for page, _, _ in programs()}
    assert {"README.md", "docs/agents/in-process.md", "docs/execution.md",
            "docs/reconcilers.md"} <= found


def checked_above() -> set[str]:
    """The programs the tests above run with their outputs checked."""
    return {readme_block("## Wrapping a call in process"),
            doc_block("docs/agents/in-process.md", "Without the decorator"),
            doc_block("docs/reconcilers.md", "# Reconcilers"),
            doc_block("docs/execution.md", "# Execution state: facts, obligations, runs")}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("page", "index", "code"),
                         [entry for entry in programs() if entry[2] not in checked_above()]
                         or [pytest.param("", 0, "", marks=pytest.mark.skip(
                             reason="every program on the site is checked above"))],
                         ids=lambda v: v if isinstance(v, str) and v.endswith(".md") else None)
def test_every_other_program_on_the_site_runs(page, index, code):
    """A page's whole program (one that sets Django up) that no test above checks runs in a
    child process against the test database and exits 0, whoever wrote the page."""
    child = spawn(code)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, f"block {index} of {page} failed:\n{err[-3000:]}"


@pytest.mark.parametrize(("page", "index", "code"), all_blocks(),
                         ids=lambda v: v if isinstance(v, str) and v.endswith(".md") else None)
def test_every_python_block_compiles(page, index, code):
    try:
        compile(code, f"{page}#{index}", "exec")
    except SyntaxError as exc:
        pytest.fail(f"expected block {index} of {page} to be Python, found {exc}")


def test_the_state_machine_on_the_front_page_is_the_state_table():
    from ledger import states

    for page in ("README.md", "docs/index.md"):
        text = (Path(ROOT) / page).read_text().split("## The state machine", 1)[1]
        diagram = text.split("```", 2)[1]
        shown = {}
        for line in diagram.splitlines():
            if "->" in line:
                source, targets = line.split("->", 1)
                targets = re.sub(r"\([^)]*\)", "", targets)
                shown[source.strip()] = {t.strip() for t in targets.split("|")}
            elif line.endswith(": terminal"):
                shown.update({s.strip(): set() for s in line.split(":")[0].split(",")})
        assert shown == {s: set(t) for s, t in states.TRANSITIONS.items()}, page
