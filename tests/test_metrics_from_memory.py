"""/metrics served from memory (issue 14): rendered at most once per new Accounts, by the
first scrape after a cycle; gzip made at most once per body; every other scrape writes the
bytes already made. Checked in-process with plain clients and with a real Prometheus."""

from __future__ import annotations

import gzip
import http.client
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from harness.prometheus import start_prometheus
from kvledger.collect.collector import Collector
from kvledger.collect.sources.document import LedgerSource
from kvledger.config.types import EngineConfig
from kvledger.output.prometheus import render_text
from kvledger.web.connection import Request
from kvledger.web.endpoints import Endpoints, accepts_gzip
from kvledger.web.server import KvledgerHTTPServer
from kvledger_engine.document_server import LedgerServer, serve_http
from kvledger_engine.reference_ledger import Ledger, PoolSpec


def _ledger() -> Ledger:
    led = Ledger([PoolSpec("0", 16, 4096, 256)], max_model_len=1024, max_num_seqs=8)
    led.admit("a", 100, 50, tenant="t1")
    led.advance("a", 100)
    return led


@pytest.fixture
def engine() -> Iterator[tuple[Ledger, LedgerServer]]:
    led = _ledger()
    server = serve_http(led.to_document, columns=lambda: led.to_document(columns=True))
    try:
        yield led, server
    finally:
        server.stop()


def _collector(url: str) -> Collector:
    return Collector([LedgerSource(EngineConfig(name="eng", kind="ledger", url=url, timeout_seconds=2.0))])


@contextmanager
def serving(url: str) -> Iterator[tuple[Collector, KvledgerHTTPServer]]:
    """A collector polling the ledger at ``url`` every second and the daemon's HTTP server
    on it, once the first accounting cycle is done; both stopped afterwards."""
    collector = _collector(url)
    collector.interval = 1.0
    collector.start()
    daemon = KvledgerHTTPServer("127.0.0.1:0", collector)
    daemon.start()
    try:
        deadline = time.monotonic() + 20
        while not collector.ready():
            assert time.monotonic() < deadline, "no accounting cycle"
            time.sleep(0.05)
        yield collector, daemon
    finally:
        daemon.stop()
        collector.stop()


def _get(endpoints: Endpoints, gzip_ok: bool) -> bytes:
    headers = {"accept-encoding": "gzip"} if gzip_ok else {}
    response = endpoints.respond(Request("GET", "/metrics", headers))
    assert response.status == 200
    assert (("Content-Encoding", "gzip") in response.headers) is gzip_ok
    return response.body


def test_one_render_per_accounts_and_one_compression_per_body(engine: tuple[Ledger, LedgerServer]) -> None:
    led, server = engine
    collector = _collector(server.url)
    first_accounts = collector.poll_once()
    endpoints = Endpoints(collector, None, json_view=False)
    assert endpoints.from_memory(Request("GET", "/metrics", {})) is None  # nothing made yet: a worker renders
    plain = [_get(endpoints, False) for _ in range(5)]
    zipped = [_get(endpoints, True) for _ in range(5)]
    assert all(b is plain[0] for b in plain) and all(b is zipped[0] for b in zipped)  # the same bytes, kept
    assert plain[0] == render_text(first_accounts)
    assert gzip.decompress(zipped[0]) == plain[0]
    assert (endpoints.metrics.renders, endpoints.metrics.compressions) == (1, 1)
    # between polls a scrape needs no worker: the event loop answers from memory
    fast = endpoints.from_memory(Request("GET", "/metrics", {"accept-encoding": "gzip"}))
    assert fast is not None and fast.body is zipped[0]
    assert endpoints.from_memory(Request("GET", "/-/ready", {})) is None

    led.admit("b", 10, 10)  # the next cycle's Accounts: rendered again, once
    second_accounts = collector.poll_once()
    assert endpoints.from_memory(Request("GET", "/metrics", {})) is None
    body = _get(endpoints, False)
    assert body == render_text(second_accounts) and body != plain[0]
    assert b'kvledger_requests{engine="eng",state="running"} 2.0' in body
    assert _get(endpoints, False) is body and endpoints.metrics.renders == 2
    assert gzip.decompress(_get(endpoints, True)) == body and endpoints.metrics.compressions == 2


def test_concurrent_scrapes_after_a_cycle_render_once(engine: tuple[Ledger, LedgerServer]) -> None:
    _, server = engine
    collector = _collector(server.url)
    collector.poll_once()
    endpoints = Endpoints(collector, None, json_view=False)
    bodies: list[bytes] = []
    threads = [threading.Thread(target=lambda: bodies.append(_get(endpoints, True))) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(bodies) == 50 and all(b is bodies[0] for b in bodies)
    assert (endpoints.metrics.renders, endpoints.metrics.compressions, endpoints.metrics.served_gzip) == (1, 1, 50)


@pytest.mark.parametrize(("header", "wanted"), [
    ("", False), ("gzip", True), ("identity", False), ("deflate, gzip;q=0.5", True), ("gzip;q=0", False),
    ("GZIP", True), ("x-gzip", True), ("br, deflate", False),
])
def test_accept_encoding(header: str, wanted: bool) -> None:
    assert accepts_gzip(header) is wanted


def _scrape(url: str, gzip_ok: bool) -> tuple[dict[str, str], bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", "/metrics", headers={"Accept-Encoding": "gzip"} if gzip_ok else {})
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    assert resp.status == 200
    return {k.lower(): v for k, v in resp.getheaders()}, body


@pytest.mark.e2e
def test_real_prometheus_scrapes_gzip_from_memory_and_plain_clients_get_text(
    tmp_path: Path, engine: tuple[Ledger, LedgerServer]
) -> None:
    _, server = engine
    with serving(server.url) as (collector, daemon):
        host, port = daemon.server_address
        with start_prometheus(tmp_path, targets=[f"{host}:{port}"], scrape_interval="1s") as prom:
            prom.wait_for_target_up()
            deadline = time.monotonic() + 30
            while prom.query_value('kvledger_requests{engine="eng",state="running"}') is None:
                assert time.monotonic() < deadline, "Prometheus never stored the ledger's series"
                time.sleep(0.2)
            assert prom.query_value('kvledger_kv_capacity_blocks{engine="eng"}') == 256
            metrics = daemon.endpoints.metrics
            assert metrics.served_gzip >= 1  # Prometheus asks for gzip, and got it
            assert metrics.renders <= collector.cycles + 1  # never more than one render per cycle
        # plain clients: text, the same page a gzip client gets for the same Accounts
        for _ in range(20):
            renders = metrics.renders
            plain_headers, plain = _scrape(daemon.url, False)
            zip_headers, zipped = _scrape(daemon.url, True)
            if metrics.renders == renders:
                break
        assert "content-encoding" not in plain_headers and zip_headers["content-encoding"] == "gzip"
        assert plain_headers["content-type"].startswith("text/plain; version=0.0.4")
        assert gzip.decompress(zipped) == plain and b"kvledger_kv_capacity_blocks" in plain
