"""Fixtures of the real llama.cpp suite (marker ``llamacpp``; run with ``make test-llamacpp``).

``llama_build`` runs ``setup_env.sh`` (a no-op once the cached build matches its spec) and
yields the server binary and the tiny model. Every test in this folder is marked
``llamacpp``; the servers themselves are started by the test modules.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .server import ensure_llamacpp

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test under tests/llamacpp_real needs the real server: mark it ``llamacpp``."""
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.llamacpp)


@pytest.fixture(scope="session")
def llama_build() -> tuple[Path, Path]:
    return ensure_llamacpp()
