"""Shared fixtures. The fake NVML fixtures live in tests/fake_nvml/ (see its __init__)."""

from __future__ import annotations

import ctypes
import functools
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

# CI replays the same examples every run (a failure there is reproducible); local runs explore.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

from fake_nvml import ENV_VAR, Inventory, build_library


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


#: a test module whose tests share a fixture wider than one test: they run on one xdist worker
_SHARED_SCOPE = re.compile(r"""scope\s*=\s*["'](?:module|class|package)["']""")


@functools.cache
def _shares_a_fixture(path: Path) -> bool:
    try:
        return bool(_SHARED_SCOPE.search(path.read_text(encoding="utf-8")))
    except OSError:
        return False


@pytest.hookimpl(optionalhook=True)  # the hook is pytest-xdist's; without xdist it is never called
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`make test` runs ``-n N --dist loadscope``. Here loadscope schedules by the unit that
    shares state: a module that defines a module-, class- or package-scoped fixture (a demo and
    its Prometheus, a built wheel, a browser) runs whole on one worker, so the fixture is made
    once, not once per worker; every other test is its own unit and goes to whichever worker
    is free (xdist's own loadscope would keep every module on one worker, and the slowest
    module would set the wall time). Units are handed out largest first (xdist's
    --loadscope-reorder). pytest-xdist's ``xdist_group`` marks cannot be used instead: with
    pytest 9 the group no longer reaches the test ids that --dist loadgroup reads."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    root = config.rootpath

    class SharedFixtureScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if _shares_a_fixture(root / module) else nodeid

    return SharedFixtureScheduling(config, log)
