"""The package reads as the architecture (docs/design.md §3): no import cycle anywhere (module
level, ``TYPE_CHECKING`` and function-local imports alike) and no loop between folders,
dependencies that point one way between the folders with no allowance the layout does not
use, nothing at the package root but the CLI and the package face, an
engine-side library that imports nothing of the daemon, the planner in one package, and
facts and formulas (``domain/``, ``policy/``) with no file I/O and nothing that only the
planner or the tests read."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from import_graph import calls, cycles, defined_names, import_graph, imported_packages, modules, parse_python, read_names

ROOT = Path(__file__).resolve().parent.parent
SOURCES = (ROOT / "exporter", "kvledger"), (ROOT / "engine", "kvledger_engine")


GRAPH = import_graph(*SOURCES)
FILES = modules(ROOT / "exporter", "kvledger")


def test_no_import_cycle() -> None:
    assert cycles(GRAPH) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    """The check itself: a cycle through a TYPE_CHECKING import and a function-local one is found."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_only_the_cli_and_the_package_face_at_the_root() -> None:
    loose = sorted(p.name for p in (ROOT / "exporter" / "kvledger").glob("*.py"))
    assert loose == ["__init__.py", "cli.py"]


def _folder(module: str) -> str:
    """The folder a module lives in: a folder under ``kvledger/`` (``collect/sources/`` and
    ``tools/plan/`` are folders of their own), the engine side, or the package root."""
    parts = module.split(".")
    if parts[0] == "kvledger_engine":
        return "kvledger_engine"
    if parts[1:3] == ["collect", "sources"]:
        return "collect.sources"
    if parts[1:3] == ["tools", "plan"]:
        return "tools.plan"
    return parts[1] if len(parts) > 1 else "kvledger"


#: folder -> the folders it may import (besides itself); the one-way flow of docs/design.md §3.
#: Every allowance is used by an import (test_every_allowance_is_needed) and none closes a loop
#: between folders (test_no_loop_between_folders).
ALLOWED: dict[str, set[str]] = {
    "kvledger_engine": set(),  # the engine side: standard library only, nothing of the daemon
    "kvledger": {"kvledger_engine"},  # the package face: the version is the engine-side library's; cli.py wires everything and is not ruled here
    "domain": {"kvledger_engine"},  # facts and accounts: data
    "policy": {"domain", "kvledger_engine"},  # pure formulas over facts
    "protocol": {"domain", "kvledger_engine"},  # the wire format into facts (the request definition and wire words from the engine side)
    # the typed configuration, its loader and the engine kinds table (engine_kinds.py, filled by
    # each kind's registration in collect/sources/<kind>/kind.py: config never imports collect)
    "config": {"domain"},
    # facts only, never the policy or outputs; collect: the folder it is part of (collect/memory.py
    # gives freed bodies back to the OS, and the registry takes each engine's configured facts from
    # collect/merge.py)
    "collect.sources": {"domain", "config", "protocol", "collect"},
    # output: the collector asks the output side's render check of each engine alone
    # (output.prometheus.check_renderable; collect/accounting.py), so that an engine no
    # exposition can carry is marked down instead of breaking the others
    "collect": {"collect.sources", "config", "domain", "policy", "output"},
    "output": {"domain", "kvledger"},  # Accounts in, text out (the package face for the version)
    # tools: the /lab page runs the cache lab's own code (tools/lab.py, standard library only),
    # the one that `kvledger lab` runs
    "web": {"output", "collect", "config", "domain", "tools", "kvledger"},
    # the generated reference: the engine kinds (their registrations: collect/sources/kinds.py) and the catalogue
    "tools": {"collect.sources", "config", "output"},
    "tools.plan": {"collect.sources", "config", "domain", "output", "policy"},  # the whole planner; only the CLI imports it
    "sim": {"kvledger_engine", "collect.sources", "config", "domain"},
    "process": set(),  # the process's own plumbing (signals): standard library only; only the CLI imports it
}


def _imports_between_folders(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """(folder, folder it imports) -> the imports that make the edge (cli.py aside)."""
    edges: dict[tuple[str, str], list[str]] = {}
    for module, targets in sorted(graph.items()):
        if module == "kvledger.cli":
            continue  # the entry point wires everything
        for t in sorted(targets):
            if _folder(module) != _folder(t):
                edges.setdefault((_folder(module), _folder(t)), []).append(f"{module} -> {t}")
    return edges


def _top(folder: str) -> str:
    """A folder's top-level folder: ``collect.sources`` is part of ``collect``."""
    return folder.split(".")[0]


def _folder_graph(edges: set[tuple[str, str]]) -> dict[str, set[str]]:
    """The graph of top-level folders (a folder within one is part of it)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        if _top(a) != _top(b):
            graph.setdefault(_top(a), set()).add(_top(b))
    return graph


def test_dependencies_point_one_way() -> None:
    wrong = [f"{imp}" for (here, there), imps in _imports_between_folders(GRAPH).items()
             if there not in ALLOWED[here] for imp in imps]
    assert wrong == []


def test_no_loop_between_folders() -> None:
    """No folder imports, through any chain of folders, a folder that imports it: in the
    imports themselves and in what the table allows."""
    assert cycles(_folder_graph(set(_imports_between_folders(GRAPH)))) == []
    assert cycles(_folder_graph({(a, b) for a, targets in ALLOWED.items() for b in targets})) == []


def test_every_allowance_is_needed() -> None:
    """The table allows no import between folders that no module makes."""
    used = set(_imports_between_folders(GRAPH))
    assert sorted((a, b) for a, targets in ALLOWED.items() for b in targets if (a, b) not in used) == []


def test_the_folder_check_finds_a_loop_between_folders() -> None:
    """The check itself: the loader importing collect while collect imports the typed
    configuration is a loop of the folders, though no module imports itself back."""
    graph = {"kvledger.config.loader": {"kvledger.collect.engine_kinds"},
             "kvledger.collect.engine_kinds": {"kvledger.config.types"}, "kvledger.config.types": set()}
    assert cycles(graph) == []
    assert cycles(_folder_graph(set(_imports_between_folders(graph)))) == [["collect", "config"]]


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.startswith("kvledger_engine")))
def test_the_engine_side_imports_nothing_of_the_daemon(module: str) -> None:
    assert not [t for t in GRAPH[module] if t.split(".")[0] == "kvledger"]


def test_sources_know_only_facts() -> None:
    """A source never imports the policy, the merge, the collector or an output."""
    for module, targets in GRAPH.items():
        if _folder(module) == "collect.sources" and module != "kvledger.collect.sources.registry":
            assert not {t for t in targets if t.startswith(("kvledger.policy", "kvledger.output", "kvledger.collect.merge", "kvledger.collect.collector"))}, module


def test_only_the_cli_imports_the_planner() -> None:
    """``kvledger plan`` is one package (``tools/plan/``): no other folder reaches into it."""
    outside = [m for m, targets in GRAPH.items() if _folder(m) != "tools.plan" and m != "kvledger.cli"
               and any(_folder(t) == "tools.plan" for t in targets)]
    assert outside == []


#: packages whose use is file, process or network I/O
IO_PACKAGES = {"http", "io", "json", "os", "pathlib", "shutil", "socket", "subprocess", "tempfile", "urllib", "yaml"}


@pytest.mark.parametrize("module", sorted(m for m in FILES if _folder(m) == "domain"))
def test_the_model_package_does_no_io(module: str) -> None:
    """Facts only: reading a file (a model's config.json) is the sources' or the planner's."""
    path = FILES[module]
    assert sorted(imported_packages(path) & IO_PACKAGES) == [] and not calls(path, "open")


def test_facts_and_formulas_hold_nothing_only_the_planner_or_the_tests_read() -> None:
    """Every public name of ``domain/`` and ``policy/`` is read by the daemon (any module
    but the planner's): what only the planner needs lives in ``tools/plan/``, what only a
    test needs lives in the test, and what nothing reads is gone."""
    read = set().union(*(read_names(path) for m, path in FILES.items() if _folder(m) != "tools.plan"))
    unread = [f"{m}.{name}" for m, path in sorted(FILES.items()) if _folder(m) in ("domain", "policy")
              for name in sorted(defined_names(path) - read)]
    assert unread == []


def test_the_name_checks_find_what_they_look_for(tmp_path: Path) -> None:
    """The checks themselves: an unread name, an I/O import and a call of open are found."""
    module = tmp_path / "m.py"
    module.write_text("import json\n\nLIMIT = 1\n\n\ndef read():\n    return open('f'), LIMIT\n\n\ndef unread():\n    return read()\n")
    assert defined_names(module) - read_names(module) == {"unread"}
    assert imported_packages(module) & IO_PACKAGES == {"json"} and calls(module, "open")


def test_the_policy_face_names_its_modules() -> None:
    """``policy/__init__.py`` lists by concern exactly the modules the package has."""
    doc = ast.get_docstring(parse_python(FILES["kvledger.policy"].read_text())) or ""
    named = set(re.findall(r"``(\w+)``", doc))
    assert named == {m.rsplit(".", 1)[1] for m in FILES if m.startswith("kvledger.policy.")}
