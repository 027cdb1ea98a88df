"""The project's modules import each other without a circle (issue 33: ``workers/scheduler.py``
and ``workers/server.py`` imported each other through ``WorkerState``).

Every import is read from the source with ``ast`` — at module level, inside functions and under
``TYPE_CHECKING`` alike — and resolved to the project file it loads (a package's
``__init__.py``, or the module). A circle is a strongly connected set of two or more files.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("app", "core", "workers", "clients")


def _module_files() -> dict[str, Path]:
    files: dict[str, Path] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            files[name] = path
    return files


def _imports(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    """The project modules that ``path`` (module ``name``) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `from a.b import c` loads a.b (and c if a module)
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of two or more nodes (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_check_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_check_reads_type_checking_imports(tmp_path: Path) -> None:
    source = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from workers.server import WorkerState\n"
    )
    (tmp_path / "m.py").write_text(source)
    known = {"workers.server": Path("workers/server.py"), "workers.m": tmp_path / "m.py"}
    assert _imports(tmp_path / "m.py", "workers.m", known) == {"workers.server"}


def test_no_module_imports_itself_through_others() -> None:
    known = _module_files()
    graph = {name: _imports(path, name, known) for name, path in known.items()}
    assert graph["workers.state"] >= {"workers.scheduler"}  # the graph is read, not empty
    assert circles(graph) == []
