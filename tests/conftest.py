"""Shared fixtures. The fake NVML fixtures live in tests/fake_nvml/ (see its __init__)."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from pathlib import Path

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
