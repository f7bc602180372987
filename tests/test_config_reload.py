"""Reloads without leaks, visible (issue 25): a configuration that fails half way closes the
sources built for it, and the daemon exports whether its latest reload succeeded."""

from __future__ import annotations

import os
import threading
import time

import pytest

from kvledger.collect.collector import Collector
from kvledger.collect.sources.registry import build_sources
from kvledger.config.loader import config_from_mapping
from kvledger.config.types import ConfigError
from kvledger.domain.accounts import ConfigReload
from kvledger.output.prometheus import render_text

# the first engine's source starts a KV-event subscriber (a thread and ZMQ sockets); the
# second engine's URL is refused when its source is built, after the first one exists
HALF_BAD = {
    "nvml": {"enabled": "false"},
    "engines": [
        {"name": "a", "kind": "vllm", "url": "http://127.0.0.1:1/metrics", "kv_events": "tcp://127.0.0.1:5599"},
        {"name": "b", "kind": "ledger", "url": "ipc:///tmp/kvledger-none"},
    ],
}


def _threads_and_fds() -> tuple[set[threading.Thread], set[str]]:
    return set(threading.enumerate()), set(os.listdir("/proc/self/fd"))


def _left_over(before: tuple[set[threading.Thread], set[str]]) -> tuple[set[threading.Thread], set[str]]:
    """Threads started and descriptors opened since ``before`` that still exist (what earlier
    tests left and ends meanwhile, on this process or this xdist worker, does not count)."""
    threads, fds = _threads_and_fds()
    return threads - before[0], fds - before[1]


def test_a_failed_build_closes_what_it_built() -> None:
    config = config_from_mapping(HALF_BAD)
    before = _threads_and_fds()
    for _ in range(20):
        with pytest.raises(ConfigError, match=r"engine 'b'.*unsupported scheme 'ipc'"):
            build_sources(config)
    deadline = time.monotonic() + 5
    while _left_over(before) != (set(), set()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _left_over(before) == (set(), set())


def test_a_failed_build_leaves_the_kept_sources_running() -> None:
    good = config_from_mapping({"nvml": {"enabled": "false"}, "engines": [HALF_BAD["engines"][0]]})
    idle = set(threading.enumerate())
    sources, _, _ = build_sources(good)
    try:
        started = set(threading.enumerate()) - idle  # engine a's KV-event subscriber
        assert started
        with pytest.raises(ConfigError):
            build_sources(config_from_mapping(HALF_BAD), previous=(good, sources))
        # engine a is unchanged: its source was kept, not closed, and nothing else runs (a
        # source's close() joins its thread: one closed by the failed build is gone by now)
        assert all(t.is_alive() for t in started)
        assert set(threading.enumerate()) - idle == started
    finally:
        for s in sources:
            s.close()


def test_the_reload_status_is_exported() -> None:
    collector = Collector(sources=[])
    text = render_text(collector.poll_once()).decode()
    assert "\nkvledger_config_last_reload_successful " not in text  # no file is reloaded (snapshot, check)
    collector.config_reload = ConfigReload(False, 1_700_000_000.0)
    text = render_text(collector.poll_once()).decode()
    assert "\nkvledger_config_last_reload_successful 0.0\n" in text
    assert "\nkvledger_config_last_reload_success_timestamp_seconds 1700000000.0\n" in text
