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
    """Every test under tests/vllm_real needs the real engine: mark it ``vllm``. Then the order
    that lets each engine shape start once (the session server, ``vllm_server``, is started by
    the first test that reads it and kept for every later one):
    - modules that never read the session server (their own shapes: test_hybrid_on_vllm.py)
      first, each stopping its servers before the next starts;
    - the modules sharing the session server, in file order; within a module, a test that
      restarts or stops it says so (``@pytest.mark.fresh_engine("why")``) and runs after the
      module's other tests, which read the server as it was;
    - last, a module that stops the shared server for a shape of its own says so at module
      level (``pytestmark = pytest.mark.fresh_engine("why")``: test_vllm_ledger_dp_async.py)."""
    ours = [i for i in items if HERE in Path(str(i.path)).resolve().parents]
    for item in ours:
        item.add_marker(pytest.mark.vllm)
    if not ours:
        return
    shared = {i.path for i in ours if "vllm_server" in getattr(i, "fixturenames", ())}

    def rank(item: pytest.Item) -> int:
        module = item.getparent(pytest.Module)
        if module is not None and any(m.name == "fresh_engine" for m in module.own_markers):
            return 2
        return 1 if item.path in shared else 0

    def own_fresh(item: pytest.Item) -> bool:
        return any(m.name == "fresh_engine" for m in item.own_markers)

    # a stable sort: collection order within each module's groups; other folders keep their places
    first = items.index(ours[0])
    ordered = sorted(ours, key=lambda i: (rank(i), str(i.path), own_fresh(i)))
    mine = set(ours)
    rest = [i for i in items if i not in mine]
    items[:] = rest[:first] + ordered + rest[first:]


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
