"""examples/frameworks/: a tool of each agent framework, through the Python client, against a
real ledger server process. Each example runs offline: the framework's own scripted model
calls the tool twice with the same arguments (a retry) and then answers.

- the retry is sent once: one article at the (non-deduplicating) service, one operation
  at attempt 1, and the model read the same article twice;
- an unknown outcome (the service commits and drops its answer) reaches the model, on the
  call and on its retry, as "Do not retry; the ledger is reconciling operation X".
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from demo.simulated.articles import ArticlesService
from ledger.models import Operation
from tests.clients.conftest import CLIENT_SRC
from tests.support.processes import ROOT
from tests.test_examples import ledger_lines

FRAMEWORKS = ROOT / "examples" / "frameworks"
EXAMPLES = sorted(path.name for path in FRAMEWORKS.glob("*.py"))


def test_every_framework_named_in_the_docs_has_an_example():
    assert EXAMPLES == ["langgraph_tool_node.py", "openai_agents_sdk.py", "pydantic_ai_tool.py"]


def run_example(name: str, server, secret: str, service: ArticlesService, title: str) -> str:
    env = dict(os.environ, LEDGER_URL=server.url, LEDGER_AGENT_KEY=secret,
               ARTICLES_URL=service.articles_url, PYTHONPATH=str(CLIENT_SRC),
               PYTHONUNBUFFERED="1")
    for variable in ("OPENAI_API_KEY", "DJANGO_SETTINGS_MODULE", "LEDGER_DATABASE_NAME"):
        env.pop(variable, None)  # offline, and nothing of the ledger's own settings
    done = subprocess.run([sys.executable, str(FRAMEWORKS / name), title], cwd="/",
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"expected {name} to exit 0, found {done.returncode}:\n" \
                                 f"{done.stdout}\n{done.stderr}"
    return done.stdout


def tool_answers(output: str) -> list[str]:
    return [line.removeprefix("tool answered: ") for line in output.splitlines()
            if line.startswith("tool answered: ")]


@pytest.mark.parametrize("name", EXAMPLES)
def test_each_adapter_wraps_its_tool_in_at_most_five_ledger_lines(name):
    source = (FRAMEWORKS / name).read_text()
    counted = ledger_lines(source)
    lines = source.splitlines()
    shown = "\n".join(f"{n}: {lines[n - 1]}" for n in counted)
    assert len(counted) <= 5, f"expected at most 5 ledger lines in {name}, found:\n{shown}"
    assert any("ledger.action(" in lines[n - 1] for n in counted), shown
    assert any("tool_message" in lines[n - 1] for n in counted), shown
    assert "import django" not in source and "from ledger " not in source


@pytest.mark.parametrize("name", EXAMPLES)
def test_a_retried_tool_call_is_sent_once_and_the_model_reads_the_same_article(
        name, server, secret):
    with ArticlesService(dedupe_keys=False) as service:
        output = run_example(name, server, secret, service, f"Once via {name}")
        articles = service.side_effects()
    assert [a["title"] for a in articles] == [f"Once via {name}"]
    [op] = Operation.objects.filter(operation="articles.create")
    assert (op.state, op.attempt, op.external_id) == ("succeeded", 1, articles[0]["id"])
    answers = tool_answers(output)
    assert len(answers) == 2, output
    assert all(articles[0]["id"] in answer for answer in answers), output


@pytest.mark.parametrize("name", EXAMPLES)
def test_an_unknown_outcome_reaches_the_model_as_do_not_retry_naming_the_operation(
        name, server, secret):
    with ArticlesService(dedupe_keys=False) as service:
        service.fail_next("drop_response")  # committed, but the answer never arrives
        output = run_example(name, server, secret, service, f"Dropped via {name}")
        articles = service.side_effects()
    assert [a["title"] for a in articles] == [f"Dropped via {name}"]
    [op] = Operation.objects.filter(operation="articles.create")
    assert (op.state, op.attempt) == ("outcome_unknown", 1)
    answers = tool_answers(output)
    assert len(answers) == 2, output
    expected = f"Do not retry; the ledger is reconciling operation {op.operation_id}."
    assert all(expected in answer for answer in answers), output
    assert all(answer.startswith("Outcome unknown: articles.create") for answer in answers)
