"""`api/` is a front end like the desk: it imports the ledger's public modules only.

Public: `ledger.<module>` and the packages `ledger.models` and `ledger.selectors` as wholes;
never a package's inner module (`ledger.selectors.approvals`) nor the internals behind the
selectors' fast path (`ledger.prepared`, `ledger.rows`), so what the API reads goes through
the same fetch-and-check as every other front end.

The MCP gateway (`api/gateway/`) goes through the agent's door like the HTTP API and /mcp:
every read and write of the ledger through `api.service`, the key and the database thread
through `api.agent`. Of the ledger it imports only the vocabulary a caller needs to read
the door's answers, `ledger.states` (states, retry policies) and `ledger.errors` (the
refusals it turns into tool errors), and these pure helpers, which touch no database:

- `ledger.canonical`: the canonical JSON the gateway's own digests of a call are made of
  (its default keys, the resources' digests), the ledger's so those keys stay what they
  were for receipts already recorded;
- `ledger.inputs`: the one gate for input (`check_json` of the arguments it digests,
  `check_identifier` of an external id before it is recorded, `storable` text, the
  operation names of its configuration), so the gateway refuses what the ledger would.

And one module, `api/gateway/reconcilers.py`, implements the reconciler plug-in interface
`ledger.reconcile` (`Reconciler`, its verdicts, `register`): it runs inside `manage.py
reconcile`, where the ledger calls it, not as an agent. An import inside `if
TYPE_CHECKING:` is a name for annotations, never run, and is not counted.
"""

import ast
from pathlib import Path

import api

INTERNAL = {"ledger.prepared", "ledger.rows"}
GATEWAY_LEDGER = {"ledger.states", "ledger.errors", "ledger.canonical", "ledger.inputs"}
GATEWAY_PLUGIN = {"reconcilers.py": {"ledger.reconcile"}}


def _ledger_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {
        id(inner) for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for statement in node.body for inner in ast.walk(statement)
    }
    names = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            if node.module == "ledger":
                names.update(f"ledger.{alias.name}" for alias in node.names)
    return {name for name in names if name.split(".")[0] == "ledger"}


def _beside_the_door(path: Path) -> list[str]:
    """The ledger modules `path` (a module of the gateway) imports besides those allowed."""
    allowed = GATEWAY_LEDGER | GATEWAY_PLUGIN.get(path.name, set())
    return sorted(name for name in _ledger_imports(path)
                  if name != "ledger" and name not in allowed)


def test_api_imports_only_public_ledger_modules():
    root = Path(api.__file__).parent
    found = sorted(
        f"{path.relative_to(root.parent)} imports {name}"
        for path in root.rglob("*.py")
        for name in _ledger_imports(path)
        if name in INTERNAL or name.count(".") > 1
    )
    assert found == [], f"expected api/ to import public ledger modules only, found {found}"


def test_the_gateway_reaches_the_ledger_through_the_agent_door():
    root = Path(api.__file__).parent / "gateway"
    modules = sorted(root.rglob("*.py"))
    assert {p.name for p in modules} >= {"server.py", "config.py", "reconcilers.py"}
    found = [f"{path.relative_to(root.parent.parent)} imports {name}"
             for path in modules for name in _beside_the_door(path)]
    assert found == [], (
        f"expected api/gateway/ to import of the ledger only {sorted(GATEWAY_LEDGER)} (and "
        f"its plug-ins' interfaces), the rest through api.service and api.agent, found "
        f"{found}")


def test_the_check_sees_an_internal_import(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from ledger import rows\nfrom ledger.selectors.approvals import gate\n")
    assert _ledger_imports(sample) >= {"ledger.rows", "ledger.selectors.approvals"}


def test_the_gateway_check_sees_a_write_beside_the_door(tmp_path):
    sample = tmp_path / "server.py"
    sample.write_text(
        "from typing import TYPE_CHECKING\n"
        "from ledger import receipts, states\n"
        "from ledger.errors import StaleVersion\n"
        "import ledger.transitions\n"
        "if TYPE_CHECKING:\n"
        "    from ledger.facts import Fact\n"
        "def read():\n"
        "    from ledger.models import AgentKey\n"
        "    from ledger import reconcile\n"
    )
    assert _beside_the_door(sample) == ["ledger.models", "ledger.receipts",
                                        "ledger.reconcile", "ledger.transitions"]
    plugin = tmp_path / "reconcilers.py"
    plugin.write_text("from ledger import reconcile\nfrom ledger import selectors\n")
    assert _beside_the_door(plugin) == ["ledger.selectors"]
