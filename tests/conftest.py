"""Shared fixtures. The fake NVML fixtures live in tests/fake_nvml/ (see its __init__)."""

from __future__ import annotations

import ast
import ctypes
import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from import_graph import parse_python

# CI replays the same examples every run (a failure there is reproducible); local runs explore.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

from fake_nvml import ENV_VAR, Inventory, build_library

import kvledger.collect.sources.kinds  # noqa: F401  (every engine kind's registration, as the CLI imports it)


@pytest.fixture(scope="session")
def fake_nvml_lib() -> ctypes.CDLL:
    """The fake libnvidia-ml.so.1, loaded into this process before pynvml's first nvmlInit.

    pynvml loads ``CDLL("libnvidia-ml.so.1")``; glibc resolves that SONAME to the object
    already loaded here, so the unmodified pynvml talks to the fake for the rest of the
    session. Without the inventory variable the fake behaves like a driverless host.
    """
    return ctypes.CDLL(str(build_library()), mode=ctypes.RTLD_GLOBAL)


class InventoryFile:
    """The inventory the fake reads; ``write`` replaces it (the fake re-reads on change)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, inventory: Inventory) -> None:
        inventory.write(self.path)


@pytest.fixture
def nvml_inventory(fake_nvml_lib: ctypes.CDLL, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[InventoryFile]:
    path = tmp_path / "nvml-inventory"
    monkeypatch.setenv(ENV_VAR, str(path))
    yield InventoryFile(path)


def _fixture_scope(decorator: ast.expr) -> str | None:
    """"function", "module", ... for a ``@pytest.fixture`` decorator (bare or called); else None."""
    call = decorator if isinstance(decorator, ast.Call) else None
    target = call.func if call else decorator
    if not (isinstance(target, ast.Attribute) and target.attr == "fixture") and not (isinstance(target, ast.Name) and target.id == "fixture"):
        return None
    for kw in call.keywords if call else ():
        if kw.arg == "scope":
            return kw.value.value if isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str) else "module"
    return "function"


@functools.cache
def _sharing_tests(path: Path) -> frozenset[str] | None:
    """The test functions (and classes) of a module that use, directly or through its other
    fixtures, a fixture of this module scoped wider than one test; None when the module cannot
    be read or has an autouse fixture wider than a test (then all of it is one unit)."""
    try:
        tree = parse_python(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return None
    fixtures: dict[str, tuple[str, list[str]]] = {}  # name: (scope, the fixtures it asks for)
    tests: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            tests[node.name] = ["<class>"]  # a class is one unit (its class-scoped fixtures)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        args = [a.arg for a in node.args.args]
        scopes = [sc for d in node.decorator_list if (sc := _fixture_scope(d)) is not None]
        if scopes:
            fixtures[node.name] = (scopes[0], args)
            autouse = any(isinstance(d, ast.Call) and any(k.arg == "autouse" for k in d.keywords) for d in node.decorator_list)
            if autouse and scopes[0] != "function":
                return None  # every test of the module uses it
        elif node.name.startswith("test"):
            tests[node.name] = args

    @functools.cache
    def wide(name: str) -> bool:
        scope, args = fixtures.get(name, ("function", []))
        return scope != "function" or any(wide(a) for a in args if a in fixtures and a != name)

    return frozenset(t for t, args in tests.items() if args == ["<class>"] or any(wide(a) for a in args if a in fixtures))


@pytest.hookimpl(optionalhook=True)  # the hook is pytest-xdist's; without xdist it is never called
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`make test` runs ``-n N --dist loadscope``. Here loadscope schedules by the unit that
    shares state: the tests of a module that use (directly or through other fixtures) one of its
    module-, class- or package-scoped fixtures (a demo and its Prometheus, a built wheel, a
    browser) run together on one worker, so the fixture is made once, not once per worker; a
    test class is one unit; every other test is its own unit and goes to whichever worker is
    free (xdist's own loadscope would keep every module on one worker, and the slowest module
    would set the wall time). Fixtures wider than a test are read from the module's source
    (conftest.py has only session-scoped ones: each worker makes its own). Units are handed out largest first (xdist's
    --loadscope-reorder). pytest-xdist's ``xdist_group`` marks cannot be used instead: with
    pytest 9 the group no longer reaches the test ids that --dist loadgroup reads."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    root = config.rootpath

    class SharedFixtureScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            module, _, rest = nodeid.partition("::")
            sharing = _sharing_tests(root / module)
            if sharing is None:
                return module
            return f"{module}::(shared fixtures)" if rest.split("::")[0].split("[")[0] in sharing else nodeid

    return SharedFixtureScheduling(config, log)
