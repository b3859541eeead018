"""examples/: each runs as written against the simulated articles service, sends once per key,
and wraps its side effect in at most five lines of ledger code.

The counting rule (`ledger_lines`): a line is ledger code when it belongs to a statement, a
decorator, or the header of an `if`/`while`/`for`/`with`/`except` that names something
imported from `ledger`, `django` or `ledger_client` (or a name assigned from such code, as
`ledger = Ledger()`), or that mentions DJANGO_SETTINGS_MODULE; every physical line of such a
statement counts (a decorator over two lines is two). Import statements do
not count. So the set-up (`os.environ.setdefault(...)`, `django.setup()`) counts, and so
does every use of `receipts` or `errors`; the side effect's own code (httpx) does not.
"""

import ast
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

from demo.simulated.articles import ArticlesService
from ledger.models import Operation
from ledger.states import State
from tests.support.processes import ROOT, child_env

EXAMPLES = Path(ROOT) / "examples"
TITLES = {
    "httpx_client.py": ("Hello from httpx", "A second article"),
    "asyncio_agent.py": ("Morning digest", "Noon digest", "Evening digest"),
    "openai_agents_tool.py": ("Tools that act once", "Receipts for tools"),
}
LEDGER_MODULES = ("ledger", "django", "ledger_client")


def ledger_lines(source: str) -> list[int]:
    """The line numbers of ledger code in `source`, by the rule in this module's docstring."""
    tree = ast.parse(source)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in LEDGER_MODULES:
            names.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names
                         if alias.name.split(".")[0] in LEDGER_MODULES)
    grew = True
    while grew:  # a name bound to ledger code is ledger code (`ledger = Ledger()`)
        grew = False
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None and any(
                    isinstance(n, ast.Name) and n.id in names for n in ast.walk(node.value)):
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    if isinstance(target, ast.Name) and target.id not in names:
                        names.add(target.id)
                        grew = True
    units = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            units.extend(node.decorator_list)
        elif isinstance(node, ast.If | ast.While):
            units.append(node.test)
        elif isinstance(node, ast.For | ast.AsyncFor):
            units.append(node.iter)
        elif isinstance(node, ast.With | ast.AsyncWith):
            units.extend(item.context_expr for item in node.items)
        elif isinstance(node, ast.ExceptHandler) and node.type is not None:
            units.append(node.type)
        elif (isinstance(node, ast.stmt) and not hasattr(node, "body")
              and not isinstance(node, ast.Import | ast.ImportFrom)):
            units.append(node)
    lines = set()
    for unit in units:
        if any(isinstance(n, ast.Name) and n.id in names
               or isinstance(n, ast.Constant) and "DJANGO_SETTINGS_MODULE" in str(n.value)
               for n in ast.walk(unit)):
            lines.update(range(unit.lineno, unit.end_lineno + 1))
    return sorted(lines)


def test_the_counting_rule_counts_ledger_statements_whole_and_never_imports():
    source = (
        "import os\n"                                                    # 1
        "import django\n"                                                # 2
        "from ledger import receipts, errors\n"                          # 3
        "os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'x')\n"         # 4 counts
        "django.setup()\n"                                               # 5 counts
        "@receipts.action('a.b', target='t',\n"                          # 6 counts
        "                 key=str)\n"                                    # 7 counts
        "def send(x):\n"                                                 # 8
        "    return os.getpid()\n"                                       # 9
        "try:\n"                                                         # 10
        "    send(1)\n"                                                  # 11
        "except errors.OutcomeUnknown:\n"                                # 12 counts
        "    pass\n"                                                     # 13
    )
    assert ledger_lines(source) == [4, 5, 6, 7, 12]


def test_a_name_bound_to_the_client_counts_wherever_it_is_used():
    source = (
        "import httpx\n"                                                 # 1
        "from ledger_client import Ledger, tool_message\n"               # 2
        "ledger = Ledger()\n"                                            # 3 counts
        "action = ledger.action('a.b', target='t', key=str)\n"           # 4 counts
        "client = httpx.Client()\n"                                      # 5
        "@action\n"                                                      # 6 counts
        "def send(x):\n"                                                 # 7
        "    return client.post('/x')\n"                                 # 8
        "on_error = lambda error: tool_message(error)\n"                 # 9 counts
    )
    assert ledger_lines(source) == [3, 4, 6, 9]


@pytest.mark.parametrize("name", sorted(TITLES))
def test_each_example_wraps_its_side_effect_in_at_most_five_ledger_lines(name):
    source = (EXAMPLES / name).read_text()
    counted = ledger_lines(source)
    lines = source.splitlines()
    shown = "\n".join(f"{n}: {lines[n - 1]}" for n in counted)
    assert len(counted) <= 5, f"expected at most 5 ledger lines in {name}, found:\n{shown}"
    assert any("receipts.action" in lines[n - 1] for n in counted), shown


def sdk_missing(name: str) -> str:
    if name != "openai_agents_tool.py":
        return ""
    try:
        importlib.metadata.version("openai-agents")
    except importlib.metadata.PackageNotFoundError:
        return ("the OpenAI Agents SDK (openai-agents) is not installed; "
                "`pip install -e '.[dev]'` installs it")
    return ""


def run_example(name: str, service: ArticlesService) -> str:
    env = child_env()
    env["ARTICLES_URL"] = service.articles_url
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.pop("OPENAI_API_KEY", None)  # offline: the tool is invoked as the runner would
    done = subprocess.run([sys.executable, str(EXAMPLES / name)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("name", sorted(TITLES))
def test_each_example_runs_twice_and_creates_one_article_per_key(name):
    if sdk_missing(name):
        pytest.skip(sdk_missing(name))
    # The service does not deduplicate keys: only the ledger stands between a second run and
    # a second article.
    with ArticlesService(dedupe_keys=False) as service:
        first = run_example(name, service)
        second = run_example(name, service)
        articles = service.side_effects()
    assert sorted(a["title"] for a in articles) == sorted(TITLES[name])
    assert len({a["idempotency_key"] for a in articles}) == len(articles)
    ops = Operation.objects.filter(operation="articles.create")
    assert sorted(op.external_id for op in ops) == sorted(a["id"] for a in articles)
    assert {op.state for op in ops} == {State.SUCCEEDED}
    for article in articles:  # the second run printed the stored results, sending nothing
        assert article["id"] in first and article["id"] in second


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("name", sorted(TITLES))
def test_a_dropped_answer_is_outcome_unknown_and_the_next_run_does_not_send_it_again(name):
    if sdk_missing(name):
        pytest.skip(sdk_missing(name))
    with ArticlesService(dedupe_keys=False) as service:
        service.fail_next("drop_response")  # committed, but the answer never arrives
        first = run_example(name, service)
        second = run_example(name, service)
        articles = service.side_effects()
    assert sorted(a["title"] for a in articles) == sorted(TITLES[name])
    [unknown] = Operation.objects.filter(operation="articles.create",
                                         state=State.OUTCOME_UNKNOWN)
    assert unknown.attempt == 1
    assert ("RemoteProtocolError" in first or "not published" in first)
    assert "OutcomeUnknown" in second or "not published" in second
    assert "is not sent again" in second
