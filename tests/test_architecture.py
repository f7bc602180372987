"""The package reads as the architecture (docs/design.md §3): no import cycle anywhere (module
level, ``TYPE_CHECKING`` and function-local imports alike), dependencies that point one way
between the folders, nothing at the package root but the CLI and the package face, and an
engine-side library that imports nothing of the daemon."""

from __future__ import annotations

from pathlib import Path

import pytest
from import_graph import cycles, import_graph

ROOT = Path(__file__).resolve().parent.parent
SOURCES = (ROOT / "exporter", "kvledger"), (ROOT / "engine", "kvledger_engine")


GRAPH = import_graph(*SOURCES)


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
    parts = module.split(".")
    if parts[0] == "kvledger_engine":
        return "kvledger_engine"
    if parts[1:3] == ["collect", "sources"]:
        return "collect.sources"
    if parts[1:3] == ["config", "model"]:
        return "config.model"
    return parts[1] if len(parts) > 1 else "kvledger"


#: folder -> the folders it may import (besides itself); the one-way flow of docs/design.md §3
ALLOWED: dict[str, set[str]] = {
    "kvledger_engine": set(),  # the engine side: standard library only, nothing of the daemon
    "model": {"kvledger_engine"},  # facts and accounts: data
    "policy": {"model", "kvledger_engine"},  # pure formulas over facts
    "protocol": {"model", "kvledger_engine"},  # the wire format into facts
    "config.model": {"model"},  # the typed configuration
    "config": {"config.model", "model", "collect"},  # the loader checks kinds against collect.engine_kinds
    "collect.sources": {"model", "config.model", "protocol", "collect", "kvledger_engine"},  # facts only: never the policy or outputs
    "collect": {"collect.sources", "config.model", "model", "policy", "output"},
    "output": {"model", "policy", "kvledger"},  # Accounts in, text out (the package face for the version)
    "web": {"output", "collect", "config.model", "config", "model", "tools", "kvledger"},
    "tools": {"collect", "collect.sources", "config.model", "config", "model", "output", "policy", "kvledger"},
    "sim": {"kvledger_engine", "collect.sources", "config.model", "model"},
    "kvledger": {"kvledger_engine"},  # the package face: the version is the engine-side library's
}


def test_dependencies_point_one_way() -> None:
    wrong = []
    for module, targets in sorted(GRAPH.items()):
        here = _folder(module)
        if module == "kvledger.cli":
            continue  # the entry point wires everything
        allowed = ALLOWED[here] | {here}
        wrong += [f"{module} -> {t}" for t in sorted(targets) if _folder(t) not in allowed]
    assert wrong == []


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.startswith("kvledger_engine")))
def test_the_engine_side_imports_nothing_of_the_daemon(module: str) -> None:
    assert not [t for t in GRAPH[module] if t.split(".")[0] == "kvledger"]


def test_sources_know_only_facts() -> None:
    """A source never imports the policy, the merge, the collector or an output."""
    for module, targets in GRAPH.items():
        if _folder(module) == "collect.sources" and module != "kvledger.collect.sources.registry":
            assert not {t for t in targets if t.startswith(("kvledger.policy", "kvledger.output", "kvledger.collect.merge", "kvledger.collect.collector"))}, module
