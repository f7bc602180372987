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

from harness.engine_fakes import FakeEngine
from kvledger.collect.engine_kinds import KINDS
from kvledger.collect.sources.base import Source, SourceError
from kvledger.collect.sources.registry import engine_sources
from kvledger.config.model import EngineConfig

ENGINE_KINDS = ["sglang", "trtllm", "triton-trtllm", "tgi"]


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
        assert source.kind == engine.kind and KINDS[engine.kind].build  # registered, built from the table
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
