"""The import graph of a package, read from its source (every import: module level, under
``TYPE_CHECKING`` and inside functions), and the names its modules define and read, for the
architecture tests."""

from __future__ import annotations

import ast
from pathlib import Path

#: CPython 3.11.7's AST conversion keeps its recursion depth in per-interpreter state: a
#: thread compiling at the same moment (a first import inside a daemon thread left by an
#: earlier test) makes ``ast.parse`` raise this SystemError (python/cpython gh-106905)
_AST_RACE = "AST constructor recursion depth mismatch"


def parse_python(source: str, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse``, parsed again when CPython's AST recursion check trips on another thread's
    compile (the source itself is fine: the same text parses on the next try)."""
    for _ in range(4):
        try:
            return ast.parse(source, filename)
        except SystemError as exc:
            if _AST_RACE not in str(exc):
                raise
    return ast.parse(source, filename)


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
        tree = parse_python(path.read_text(), str(path))
        targets = _imported(tree, name, path.name == "__init__.py", known)
        graph[name] = {t for t in targets if t in known and t != name}
    return graph


def imported_packages(path: Path) -> set[str]:
    """The top-level package of every absolute import of a module (``json``, ``pathlib``,
    ``kvledger``), wherever the import is."""
    out: set[str] = set()
    for n in ast.walk(parse_python(path.read_text(), str(path))):
        if isinstance(n, ast.Import):
            out.update(a.name.split(".")[0] for a in n.names)
        elif isinstance(n, ast.ImportFrom) and not n.level and n.module:
            out.add(n.module.split(".")[0])
    return out


def defined_names(path: Path) -> set[str]:
    """The public names a module defines at its top level (functions, classes, assignments)."""
    out: set[str] = set()
    for n in parse_python(path.read_text(), str(path)).body:
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(n.name)
        elif isinstance(n, ast.Assign):
            out.update(t.id for t in n.targets if isinstance(t, ast.Name))
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
    return {name for name in out if not name.startswith("_")}


def read_names(path: Path) -> set[str]:
    """Every name a module reads: as a variable, as an attribute or in a ``from`` import."""
    out: set[str] = set()
    for n in ast.walk(parse_python(path.read_text(), str(path))):
        if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Store):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.ImportFrom):
            out.update(a.name for a in n.names)
    return out


def calls(path: Path, name: str) -> bool:
    """Whether a module calls the builtin-looking ``name`` (``open``)."""
    tree = parse_python(path.read_text(), str(path))
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name for n in ast.walk(tree))


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
