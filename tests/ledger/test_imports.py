"""The modules of `ledger` import each other without a cycle, and reads never import writers.

Read from the source with `ast` (every import, at module level or inside a function), so a
cycle hidden behind a function-level import is found too. One exception: a module-level
`__getattr__` (PEP 562) that re-exports names of a module built on this one (receipts
offers the agent kit of `ledger.agent_kit` as `receipts.action`, ...) is an alias, not a
dependency of the module it sits in.
"""

import ast
from pathlib import Path

import ledger

ROOT = Path(ledger.__file__).parent
# Modules that write; `ledger.selectors` may import none of them (but the retention rules).
WRITERS = {"ledger.receipts", "ledger.facts", "ledger.runs", "ledger.obligations",
           "ledger.episodes", "ledger.reconcile", "ledger.leases", "ledger.transitions"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def ledger_modules() -> dict[str, Path]:
    return {
        module_name(path): path
        for path in ROOT.rglob("*.py")
        if "migrations" not in path.parts
    }


def imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The ledger modules `name` imports, with each package whose __init__ an import runs
    (except the packages `name` itself lives in)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    tree = ast.parse(path.read_text(), str(path))
    tree.body = [node for node in tree.body
                 if not (isinstance(node, ast.FunctionDef) and node.name == "__getattr__")]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names
                           if f"{base}.{alias.name}" in modules)
    edges = set()
    for target in targets:
        parts = target.split(".")
        for depth in range(2, len(parts) + 1):
            prefix = ".".join(parts[:depth])
            inside = name == prefix or name.startswith(prefix + ".")
            if prefix in modules and not inside:
                edges.add(prefix)
    return edges


def import_graph() -> dict[str, set[str]]:
    modules = ledger_modules()
    return {name: imported(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path that starts and ends at the same module, or None."""
    done, stack, on_stack = set(), [], set()

    def visit(node):
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_stack:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in done:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        on_stack.discard(node)
        done.add(node)
        return None

    for node in sorted(graph):
        if node not in done:
            found = visit(node)
            if found:
                return found
    return None


def test_the_graph_is_read_from_the_source():
    graph = import_graph()
    assert "ledger.selectors.operations" in graph["ledger.selectors"]
    assert "ledger.selectors.facts" in graph["ledger.facts"]
    assert "ledger.runs" in graph["ledger.receipts"]


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import():
    graph = {"ledger.facts": {"ledger.runs"}, "ledger.runs": {"ledger.leases", "ledger.facts"},
             "ledger.leases": set()}
    assert find_cycle(graph) == ["ledger.facts", "ledger.runs", "ledger.facts"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_ledger_modules_import_each_other_without_a_cycle():
    assert find_cycle(import_graph()) is None


def test_reads_import_no_writer():
    graph = import_graph()
    for name, targets in graph.items():
        if name.startswith("ledger.selectors"):
            assert not targets & WRITERS, f"{name} imports {sorted(targets & WRITERS)}"
