"""Fixtures of the real-SGLang suite (marker ``sglang``; run with ``make test-sglang``).

Server starts are the suite's cost (20-50 s each on the 2-core machine), so each shape is
started ONCE per session, lazily, and shared by every test that needs it; a test that changes
the engine's state restores it (the frozen-point tests pause and resume; ``flush_cache`` empties
the radix cache for the next one):

- ``sglang_server``: a tiny Llama, ``--decode-log-interval 1`` (the gauges follow every step:
  where exactness is checked), a pool of ``EXACT_POOL_TOKENS`` tokens, the test-only recount
  plugin, plus the plugins named in ``SESSION_PLUGINS``: kvledger's own SGLang plugin, run from
  a per-checkout venv layered on the shared one (``server.kvledger_venv``), serving its ledger
  at ``server.ledger_url`` (the in-engine plugin's tests share this server; the plugin only
  reads the scheduler's state);
- ``sglang_server_default_interval``: a tiny Qwen3 at SGLang's default decode-log interval (40
  steps), with the recount: where the lag of /metrics behind the allocator is measured.

Every test in this folder is marked ``sglang``. The summary lists each server's start time and log.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from .server import SglangServer, ensure_sglang_env, free_tcp_port, kvledger_venv, make_tiny_model

HERE = Path(__file__).resolve().parent
#: the session server's pool, in tokens (pages of one token): small enough that a burst of
#: requests admitted on SGLang's estimate runs out and SGLang retracts
EXACT_POOL_TOKENS = 2048
#: plugins of the group sglang.srt.plugins the session server loads besides the recount:
#: kvledger's SGLang plugin (engine/kvledger_engine/sglang)
SESSION_PLUGINS: tuple[str, ...] = ("kvledger",)

_servers: list[tuple[str, SglangServer]] = []
#: lines for the summary's "real SGLang" section (measurements the tests made)
SUMMARY: list[str] = []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test under tests/sglang_real needs the real engine: mark it ``sglang``."""
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.sglang)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _servers or SUMMARY:
        terminalreporter.section("real SGLang")
        for name, server in _servers:
            starts = ", ".join(f"{s:.1f} s" for s in server.start_history)
            terminalreporter.write_line(f"{name}: server starts (to healthy): {starts}; log: {server.log_path}")
        for line in SUMMARY:
            terminalreporter.write_line(line)


def start_shared(name: str, server: SglangServer) -> SglangServer:
    """Start a session server and list it in the summary."""
    _servers.append((name, server))
    server.start()
    return server


@pytest.fixture(scope="session")
def sglang_env() -> None:
    ensure_sglang_env()


@pytest.fixture(scope="session")
def tiny_llama_dir(sglang_env: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(sglang_env: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3")


@pytest.fixture(scope="session")
def sglang_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SglangServer]:
    log = tmp_path_factory.mktemp("sglang-log") / "sglang-llama.log"
    ledger = Path(tempfile.mkdtemp(prefix="kvl-sglang-", dir="/tmp")) / "ledger.sock"  # a short path (107 bytes)
    # SGLANG_INIT_NEW_TOKEN_RATIO: SGLang admits a request that may stop at EOS on this share of its
    # remaining output (0.7 by default, decaying over 600 steps; 1.0 again after a retraction). At
    # 0.2 the overcommitted burst is admitted whole however its requests arrive, and must retract.
    server = SglangServer(tiny_llama_dir, free_tcp_port(), max_total_tokens=EXACT_POOL_TOKENS,
                          decode_log_interval=1, recount=True, plugins=SESSION_PLUGINS, log_path=log,
                          venv=kvledger_venv(), extra_env={"KVLEDGER_SGLANG_LEDGER": f"unix://{ledger}",
                                                           "SGLANG_INIT_NEW_TOKEN_RATIO": "0.2"})
    server.ledger_url = f"unix://{ledger}"
    try:
        yield start_shared("llama, --decode-log-interval 1", server)
    finally:
        server.close()


@pytest.fixture(scope="session")
def sglang_server_default_interval(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SglangServer]:
    log = tmp_path_factory.mktemp("sglang-log") / "sglang-qwen3.log"
    server = SglangServer(tiny_qwen3_dir, free_tcp_port(), max_total_tokens=4096, decode_log_interval=None,
                          recount=True, log_path=log)
    try:
        yield start_shared("qwen3, default --decode-log-interval", server)
    finally:
        server.close()
