"""Fixtures of the real-vLLM suite (marker ``vllm``; run with ``make test-vllm``).

The session fixture ``vllm_server`` runs ``setup_env.sh`` (a no-op once the separate venv
matches its spec), builds the tiny model in a temporary directory and starts ONE vLLM
server for the whole session. It yields a :class:`VllmServer` with ``metrics_url``,
``events_url`` (``tcp://127.0.0.1:PORT``), ``replay_url``, ``burst(...)``, ``start()``,
``stop()`` and ``restart()``. Tests that stop or restart it leave it running again.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .server import VllmServer, ensure_vllm_env, free_tcp_port, make_tiny_model

HERE = Path(__file__).resolve().parent
_servers: list[VllmServer] = []
_logs: list[Path] = []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test under tests/vllm_real needs the real engine: mark it ``vllm``."""
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.vllm)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _servers or _logs:
        terminalreporter.section("real vLLM")
        for server in _servers:
            starts = ", ".join(f"{s:.1f} s" for s in server.start_history)
            flags = f" ({' '.join(server.extra_args)})" if server.extra_args else ""
            terminalreporter.write_line(f"server starts (to healthy){flags}: {starts}")
        for log in _logs:
            terminalreporter.write_line(f"server log: {log}")


def track_server(server: VllmServer) -> None:
    """A module's own server: its start times and log in the summary."""
    _servers.append(server)
    _logs.append(server.log_path)


def stop_shared_servers() -> None:
    """Stop every server started so far (a module that runs its own engine last gives it the
    machine); a stopped session server is not started again."""
    for server in _servers:
        server.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ensure_vllm_env()
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def vllm_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("vllm-log") / "vllm.log"
    _logs.append(log)
    server = VllmServer(
        tiny_model_dir, free_tcp_port(), free_tcp_port(), free_tcp_port(), log_path=log
    )
    try:
        _servers.append(server)
        server.start()
        yield server
    finally:
        server.close()
