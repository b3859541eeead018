"""The Python and the TypeScript clients record one intent for one call: a Python agent and
a TypeScript agent (node, clients/typescript/src) on one key make one effect, whichever
goes first, instead of IdempotencyKeyReused in the second."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tests.support.processes import ROOT

pytestmark = pytest.mark.skipif(shutil.which("node") is None,
                                reason="node not found: the TypeScript agent cannot run")

ARTICLE = {"slug": "cross-language", "title": "One effect", "tags": ["a", "b"], "n": 1}

TS_AGENT = """
import * as client from "%(src)s";
const ledger = new client.Ledger(process.env.LEDGER_URL, { key: process.env.LEDGER_AGENT_KEY });
const effects = [];
const create = ledger.action(process.env.OPERATION, {
  target: "https://cms.example/articles", key: (article) => process.env.KEY,
}, async (article) => { effects.push(article.slug); return { id: "ts-1", by: "typescript" }; });
try {
  const result = await create(JSON.parse(process.env.ARTICLE));
  console.log(JSON.stringify({ result, effects }));
} catch (exc) {
  console.log(JSON.stringify({ error: exc.name, message: exc.message, effects }));
}
"""


def typescript_agent(server, secret, operation: str, key: str) -> dict:
    done = subprocess.run(
        ["node", "--input-type=module", "-e",
         TS_AGENT % {"src": str(ROOT / "clients" / "typescript" / "src" / "index.js")}],
        env={"PATH": "/usr/bin:/bin", "LEDGER_URL": server.url, "LEDGER_AGENT_KEY": secret,
             "OPERATION": operation, "KEY": key, "ARTICLE": json.dumps(ARTICLE)},
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"expected the TypeScript agent to run, found {done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("first", ["python", "typescript"])
def test_a_python_and_a_typescript_agent_on_one_key_make_one_effect(ledger, server, secret,
                                                                    first):
    operation, key = f"cms.create-{first}-first", f"article-{first}-first"
    effects = []

    @ledger.action(operation, target="https://cms.example/articles", key=lambda article: key)
    def create(article: dict) -> dict:
        effects.append(article["slug"])
        return {"id": "py-1", "by": "python"}

    if first == "python":
        assert create(dict(ARTICLE)) == {"id": "py-1", "by": "python"}
        other = typescript_agent(server, secret, operation, key)
        assert other == {"result": {"id": "py-1", "by": "python"}, "effects": []}, (
            f"expected the TypeScript agent to get Python's stored result without calling, "
            f"found {other}")
        assert effects == ["cross-language"]
    else:
        other = typescript_agent(server, secret, operation, key)
        assert other == {"result": {"id": "ts-1", "by": "typescript"},
                         "effects": ["cross-language"]}, other
        assert create(dict(ARTICLE)) == {"id": "ts-1", "by": "typescript"}, (
            "expected the Python agent to get TypeScript's stored result without calling")
        assert effects == []
    receipt = create.receipt(dict(ARTICLE))
    assert receipt.intent == ARTICLE, f"expected the canonical intent, found {receipt.intent}"
