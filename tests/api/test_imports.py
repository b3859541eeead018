"""`api/` is a front end like the desk: it imports the ledger's public modules only.

Public: `ledger.<module>` and the packages `ledger.models` and `ledger.selectors` as wholes;
never a package's inner module (`ledger.selectors.approvals`) nor the internals behind the
selectors' fast path (`ledger.prepared`, `ledger.rows`), so what the API reads goes through
the same fetch-and-check as every other front end.
"""

import ast
from pathlib import Path

import api

INTERNAL = {"ledger.prepared", "ledger.rows"}


def _ledger_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            if node.module == "ledger":
                names.update(f"ledger.{alias.name}" for alias in node.names)
    return {name for name in names if name.split(".")[0] == "ledger"}


def test_api_imports_only_public_ledger_modules():
    root = Path(api.__file__).parent
    found = sorted(
        f"{path.relative_to(root.parent)} imports {name}"
        for path in root.rglob("*.py")
        for name in _ledger_imports(path)
        if name in INTERNAL or name.count(".") > 1
    )
    assert found == [], f"expected api/ to import public ledger modules only, found {found}"


def test_the_check_sees_an_internal_import(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from ledger import rows\nfrom ledger.selectors.approvals import gate\n")
    assert _ledger_imports(sample) >= {"ledger.rows", "ledger.selectors.approvals"}
