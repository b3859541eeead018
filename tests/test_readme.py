"""The README's agent example runs as written, twice, and sends only once."""

import re
from pathlib import Path

import pytest

from ledger.models import Operation
from tests.support.processes import ROOT, spawn

README = (Path(ROOT) / "README.md").read_text()


def readme_block(heading: str, index: int = 0) -> str:
    section = README.split(heading, 1)[1]
    return re.findall(r"```python\n(.*?)```", section, re.S)[index]


@pytest.mark.django_db(transaction=True)
def test_the_agent_example_in_the_readme_runs_and_replays_without_sending():
    code = readme_block("## Writing receipts from an agent", 1)
    outputs = []
    for _ in range(2):
        child = spawn(code)
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        outputs.append(out)
    assert "succeeded article-42 {'Authorization': '[redacted]'}" in outputs[0]
    assert "already recorded, not sending again" in outputs[1]
    assert Operation.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_the_decorator_example_in_the_readme_sends_once_then_returns_the_stored_result():
    code = readme_block("## Writing receipts from an agent")
    outputs = []
    for _ in range(2):
        child = spawn(code)
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        outputs.append(out)
    assert "sending hello-world" in outputs[0]
    assert "sending" not in outputs[1]
    assert "result {'id': 'article-7', 'slug': 'hello-world'}" in outputs[1]
    op = Operation.objects.get()
    assert (op.external_id, op.result) == ("article-7", {"id": "article-7", "slug": "hello-world"})
