"""The sglang, trtllm, triton-trtllm and tgi sources against fake engines on real sockets
(tests/harness/engine_fakes.py): a poll maps the served exposition and follows its changes;
an error status, garbage, a poisoned value, a hang and a vanished engine each fail the poll
with their own reason and a message naming the engine's address."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator

import pytest

from harness.engine_fakes import KINDS as FAKES
from harness.engine_fakes import FakeEngine
from kvledger.collect.sources.base import Source, SourceError
from kvledger.collect.sources.registry import engine_sources
from kvledger.config.engine_kinds import KINDS
from kvledger.config.types import EngineConfig

#: the registered kinds that read an exposition a fake engine serves
ENGINE_KINDS = [k for k in KINDS if k in FAKES]


def source_for(engine: FakeEngine, timeout: float = 2.0, **kw) -> Source:  # type: ignore[no-untyped-def]
    cfg = EngineConfig(name=f"e-{engine.kind}", kind=engine.kind, url=engine.url, timeout_seconds=timeout, **kw)
    (source,) = engine_sources(cfg)  # what the daemon builds: the kind's registration
    return source


@pytest.fixture(params=ENGINE_KINDS)
def engine(request: pytest.FixtureRequest) -> Iterator[FakeEngine]:
    with FakeEngine(request.param) as e:
        yield e


def in_use(source: Source) -> int | None:
    facts = source.poll().facts  # type: ignore[attr-defined]
    return facts.pools[0].in_use if facts.pools[0].in_use is not None else facts.pools[0].reserved_blocks


def test_poll_maps_the_exposition_and_follows_its_changes(engine: FakeEngine) -> None:
    source = source_for(engine)
    try:
        assert source.kind == engine.kind and type(source) is KINDS[engine.kind].source  # registered, built from the table
        facts = source.poll().facts  # type: ignore[attr-defined]
        assert (facts.name, facts.kind, facts.source) == (f"e-{engine.kind}", engine.kind, engine.kind)
        first = in_use(source)
        engine.advance()
        second = in_use(source)
        assert first is not None and second is not None and first != second
    finally:
        source.close()


@pytest.mark.parametrize(("mode", "reason"), [("status", "http_status"), ("garbage", "parse"), ("poison", "parse")])
def test_faults_fail_the_poll_with_their_reason(engine: FakeEngine, mode: str, reason: str) -> None:
    source = source_for(engine)
    try:
        engine.mode = mode
        with pytest.raises(SourceError) as err:
            source.poll()
        assert err.value.reason == reason, err.value
        if mode == "status":
            assert f"127.0.0.1:{engine.port}" in str(err.value) and "503" in str(err.value)
        elif mode == "garbage":  # names the first line that is no exposition
            assert str(err.value).startswith("invalid exposition line 1")
        else:  # names the poisoned series and what is wrong with it
            assert engine.spec.poison[0].split("{")[0] in str(err.value)
        engine.mode = "ok"
        assert source.poll().facts.pools  # type: ignore[attr-defined]
    finally:
        source.close()


def test_a_hanging_engine_times_out_within_its_deadline(engine: FakeEngine) -> None:
    source = source_for(engine, timeout=0.5)
    try:
        engine.mode = "hang"  # it answers only when the engine stops (30 s at most)
        with pytest.raises(SourceError) as err:
            source.poll()
        assert err.value.reason == "timeout" and "within 0.5s" in str(err.value)
    finally:
        source.close()


def test_an_engine_that_disappears_is_a_connect_error_until_it_returns(engine: FakeEngine) -> None:
    source = source_for(engine, timeout=1.0)
    try:
        engine.disappear()
        with pytest.raises(SourceError) as err:
            source.poll()
        assert err.value.reason == "connect"
        engine.reappear()
        assert source.poll().facts.pools  # type: ignore[attr-defined]
    finally:
        source.close()


class _Info(http.server.BaseHTTPRequestHandler):
    body = b'{"page_size": 16, "tp_size": 2}'

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


def test_sglang_reads_page_size_from_server_info_when_metrics_has_none() -> None:
    info = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Info)
    threading.Thread(target=info.serve_forever, daemon=True).start()
    engine = FakeEngine("sglang")
    # an older build: no sglang:page_size, capacity and used tokens in whole pages of 16
    engine.base = "\n".join(line for line in engine.base.splitlines()
                            if not line.startswith(("sglang:page_size", "sglang:num_pages", "# HELP sglang:page_size",
                                                    "# TYPE sglang:page_size", "# HELP sglang:num_pages",
                                                    "# TYPE sglang:num_pages"))) + "\n"
    cfg = EngineConfig(name="old", kind="sglang", url=engine.url,
                       options=(("server_info_url", f"http://127.0.0.1:{info.server_address[1]}/get_server_info"),))
    (source,) = engine_sources(cfg)
    try:
        (pool,) = source.poll().facts.pools  # type: ignore[attr-defined]
        assert (pool.block_size, pool.num_blocks, pool.in_use) == (16, 16384, 3072)
        _Info.body = json.dumps({"page_size": "sixteen"}).encode()
        assert source.poll().facts.pools[0].block_size == 16  # type: ignore[attr-defined]  # read once, kept
    finally:
        source.close()
        engine.stop()
        info.shutdown()
        info.server_close()


class _SglangWithInfo(http.server.BaseHTTPRequestHandler):
    """SGLang's /metrics (the fake's capture) and /server_info on one origin, as a server has them."""

    metrics = b""
    info: bytes | None = b'{"decode_log_interval": 40, "page_size": 1}'
    info_reads = 0

    def do_GET(self) -> None:
        if self.path == "/metrics":
            status, body = 200, self.metrics
        elif self.path == "/server_info" and self.info is not None:
            type(self).info_reads += 1
            status, body = 200, self.info
        else:
            status, body = 404, b"not found\n"
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def sglang_with_info() -> Iterator[str]:
    fake = FakeEngine("sglang")
    _SglangWithInfo.metrics = fake.body()
    fake.stop()
    _SglangWithInfo.info = b'{"decode_log_interval": 40, "page_size": 1}'
    _SglangWithInfo.info_reads = 0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SglangWithInfo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()


def test_sglang_states_its_decode_log_interval_from_server_info_beside_metrics(sglang_with_info: str) -> None:
    """SGLang's gauges lag by up to --decode-log-interval decode steps: the source reads the
    interval from /server_info beside /metrics once (it passes through SGLang's scheduler),
    again only after a failed poll."""
    (source,) = engine_sources(EngineConfig(name="s", kind="sglang", url=sglang_with_info, timeout_seconds=2))
    try:
        for _ in range(3):
            source.poll()
        assert source.refresh_interval_steps() == 40 and _SglangWithInfo.info_reads == 1
        _SglangWithInfo.info = b'{"decode_log_interval": 1}'
        source.poll()
        assert source.refresh_interval_steps() == 40  # not read at every poll
        metrics, _SglangWithInfo.metrics = _SglangWithInfo.metrics, b"garbage{"
        with pytest.raises(SourceError):
            source.poll()
        _SglangWithInfo.metrics = metrics
        source.poll()  # the engine came back (perhaps restarted with other flags): read again
        assert source.refresh_interval_steps() == 1 and _SglangWithInfo.info_reads == 2
    finally:
        source.close()


@pytest.mark.parametrize("info", [None, b'{"decode_log_interval": "forty"}', b"[1, 2]", b'{"page_size": 1}'])
def test_an_unknown_decode_log_interval_leaves_the_series_absent_and_the_poll_up(sglang_with_info: str, info: bytes | None) -> None:
    _SglangWithInfo.info = info
    (source,) = engine_sources(EngineConfig(name="s", kind="sglang", url=sglang_with_info, timeout_seconds=2))
    try:
        assert source.poll().facts.pools[0].in_use is not None  # type: ignore[attr-defined]
        assert source.refresh_interval_steps() is None
    finally:
        source.close()


def test_the_configured_decode_log_interval_wins_and_nothing_is_read(sglang_with_info: str) -> None:
    cfg = EngineConfig(name="s", kind="sglang", url=sglang_with_info, timeout_seconds=2, options=(("decode_log_interval", "1"),))
    (source,) = engine_sources(cfg)
    try:
        source.poll()
        assert source.refresh_interval_steps() == 1 and _SglangWithInfo.info_reads == 0
    finally:
        source.close()


def test_the_refresh_interval_is_exported_per_source(sglang_with_info: str) -> None:
    from kvledger.collect.collector import Collector
    from kvledger.output.prometheus import render_text

    (source,) = engine_sources(EngineConfig(name="s", kind="sglang", url=sglang_with_info, timeout_seconds=2))
    collector = Collector(sources=[source])
    text = render_text(collector.poll_once()).decode()
    assert 'kvledger_source_refresh_interval_steps{engine="s",source="sglang"} 40.0' in text
