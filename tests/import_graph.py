"""The import graph of a package, read from its source (every import: module level, under
``TYPE_CHECKING`` and inside functions), for the architecture tests."""

from __future__ import annotations

import ast
from pathlib import Path


def module_name(root: Path, path: Path) -> str:
    """``kvledger.collect.merge`` for ``<root>/kvledger/collect/merge.py`` (a package is its ``__init__``)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path, package: str) -> dict[str, Path]:
    return {module_name(root, p): p for p in sorted((root / package).rglob("*.py"))}


def _imported(node: ast.AST, me: str, is_package: bool, known: set[str]) -> set[str]:
    out: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Import):
            out.update(a.name for a in n.names)
        elif isinstance(n, ast.ImportFrom):
            if n.level:
                base = me.split(".") if is_package else me.split(".")[:-1]
                base = base[: len(base) - (n.level - 1)]
                target = ".".join([*base, *([n.module] if n.module else [])])
            else:
                target = n.module or ""
            out.add(target)
            # ``from pkg import submodule`` imports the submodule
            out.update(f"{target}.{a.name}" for a in n.names if f"{target}.{a.name}" in known)
    return out


def import_graph(*sources: tuple[Path, str]) -> dict[str, set[str]]:
    """module -> the modules of the given packages it imports, for each ``(source root,
    package)`` (a package's ``__init__`` is an edge only where it is imported by name)."""
    found: dict[str, Path] = {}
    for root, package in sources:
        found.update(modules(root, package))
    known = set(found)
    graph: dict[str, set[str]] = {}
    for name, path in found.items():
        tree = ast.parse(path.read_text(), str(path))
        targets = _imported(tree, name, path.name == "__init__.py", known)
        graph[name] = {t for t in targets if t in known and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found
