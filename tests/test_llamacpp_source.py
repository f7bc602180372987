"""LlamacppSource against a real local HTTP server serving llama.cpp's captured answers:
the three GETs, the URL forms, /metrics as an optional part, a sleeping server, faults."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvledger.collect.sources.base import EngineContribution, SourceError, SubsourceReport
from kvledger.collect.sources.llamacpp.source import LlamacppSource, endpoints
from kvledger.collect.sources.registry import build_sources
from kvledger.config.loader import load_config
from kvledger.config.types import EngineConfig
from kvledger.domain.limits import MAX_TEXT_LINES

FIXTURES = Path(__file__).parent / "fixtures" / "llamacpp"
CASE = "llamacpp-pre13660"
BODIES = {
    "/slots": (FIXTURES / f"{CASE}-slots.json").read_bytes(),
    "/props": (FIXTURES / f"{CASE}-props.json").read_bytes(),
    "/metrics": (FIXTURES / f"{CASE}-metrics.txt").read_bytes(),
}
NOT_SUPPORTED = b'{"error":{"code":501,"message":"This server does not support metrics endpoint.","type":"not_supported_error"}}'


class _Handler(http.server.BaseHTTPRequestHandler):
    modes: dict[str, str]  # path -> ok | 501 | garbage | hang | sleeping
    seen: list[str]
    release: threading.Event

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        type(self).seen.append(path)
        mode = type(self).modes.get(path, "ok")
        if mode == "hang":
            type(self).release.wait(10)
            return
        status, body = {
            "ok": (200, BODIES.get(path.removeprefix("/llama"), b"")),
            "501": (501, NOT_SUPPORTED),
            "garbage": (200, b"<html>oops</html>\n"),
            # one sample whose timestamp has 312 digits: prometheus_client's int / 1000 overflows
            "timestamp": (200, BODIES["/metrics"] + b"llamacpp:requests_processing 1 " + b"9" * 312 + b"\n"),
            "too_long": (200, b"llamacpp:n_busy_slots_per_decode 1\n" * (MAX_TEXT_LINES + 1)),
            "sleeping": (200, b'{"total_slots": 4, "build_info": "b11434-x", "is_sleeping": true}'),
        }[mode]
        if path.removeprefix("/llama") not in BODIES:
            status, body = 404, b'{"error":{"code":404}}'
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[tuple[str, type[_Handler]]]:
    handler = type("H", (_Handler,), {"modes": {}, "seen": [], "release": threading.Event()})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", handler
    handler.release.set()
    httpd.shutdown()
    httpd.server_close()


def _cfg(url: str, timeout_seconds: float = 2.0, **options: object) -> EngineConfig:
    return EngineConfig(name="llama", kind="llamacpp", url=url, timeout_seconds=timeout_seconds, block_bytes=4096,
                        options=tuple((k, str(v)) for k, v in options.items()))


@pytest.mark.parametrize(
    ("url", "base", "metrics"),
    [
        ("http://h:8080/metrics", "http://h:8080", "http://h:8080/metrics"),
        ("http://h:8080", "http://h:8080", "http://h:8080/metrics"),
        ("http://h:8080/", "http://h:8080", "http://h:8080/metrics"),
        ("https://u:p@h/llama/metrics", "https://u:p@h/llama", "https://u:p@h/llama/metrics"),
        ("http://h:8080/llama/", "http://h:8080/llama", "http://h:8080/llama/metrics"),
    ],
)
def test_endpoints_from_the_url(url: str, base: str, metrics: str) -> None:
    assert endpoints(url) == (base, metrics)


@pytest.mark.parametrize("form", ["/metrics", "", "/"])
def test_poll_reads_props_slots_and_metrics(server, form: str) -> None:
    base, handler = server
    src = LlamacppSource(_cfg(base + form))
    try:
        contribution = src.poll()
        assert isinstance(contribution, EngineContribution)
        facts = contribution.facts
        assert (src.kind, src.engine, facts.name, facts.kind, facts.version) == ("llamacpp", "llama", "llama", "llamacpp", "b0-unknown")
        assert facts.pools[0].num_blocks == 8192 and facts.pools[0].reserved_blocks == 4096
        assert facts.request_counts is not None and facts.request_counts.waiting == 1  # from /metrics
        assert handler.seen == ["/props", "/metrics", "/slots"]
        assert src.subsource_health() == [SubsourceReport("metrics", True, None)]
    finally:
        src.close()


def test_slots_and_props_urls_from_options(server) -> None:
    base, handler = server
    src = LlamacppSource(_cfg(base + "/metrics", slots_url=base + "/llama/slots", props_url=base + "/llama/props"))
    try:
        src.poll()
        assert handler.seen == ["/llama/props", "/metrics", "/llama/slots"]
    finally:
        src.close()


@pytest.mark.parametrize("mode", ["501", "garbage", "hang", "timestamp", "too_long"])
def test_metrics_failure_is_a_subsource_down_not_a_failed_poll(server, mode: str) -> None:
    base, handler = server
    handler.modes["/metrics"] = mode
    src = LlamacppSource(_cfg(base, timeout_seconds=1.0))
    try:
        facts = src.poll().facts
        # the three GETs share the poll's deadline: /metrics failing (or hanging until its share
        # of the deadline, its answer held back for 10 s) leaves /slots its time to be read
        assert handler.seen == ["/props", "/metrics", "/slots"]
        assert facts.pools[0].num_blocks == 8192
        assert facts.request_counts is not None and facts.request_counts.waiting is None  # unknown, not zero
        (report,) = src.subsource_health()
        assert report.name == "metrics" and not report.up and report.message
        expected = {"501": "http_status: ", "garbage": "parse: ", "hang": "timeout: ", "timestamp": "parse: ",
                    "too_long": "too_large: "}[mode]
        assert report.message.startswith(expected), report.message
    finally:
        src.close()


def test_an_error_of_ours_reading_metrics_does_not_fail_the_poll(server, monkeypatch: pytest.MonkeyPatch) -> None:
    """/metrics is optional ("never fails the poll"): not even an exception no parser names does."""
    base, _ = server

    def broken(text: str, deadline: float | None = None) -> None:
        raise OverflowError("integer division result too large for a float")

    monkeypatch.setattr("kvledger.collect.sources.llamacpp.source.parse_metrics", broken)
    src = LlamacppSource(_cfg(base))
    try:
        facts = src.poll().facts
        assert facts.pools[0].num_blocks == 8192
        (report,) = src.subsource_health()
        assert not report.up and report.message == "internal: OverflowError: integer division result too large for a float"
    finally:
        src.close()


@pytest.mark.parametrize(
    ("path", "mode", "reason"),
    [("/slots", "501", "http_status"), ("/slots", "garbage", "parse"), ("/props", "garbage", "parse"),
     ("/slots", "hang", "timeout"), ("/props", "hang", "timeout")],
)
def test_slots_or_props_failure_fails_the_poll(server, path: str, mode: str, reason: str) -> None:
    base, handler = server
    handler.modes[path] = mode
    src = LlamacppSource(_cfg(base, timeout_seconds=0.5))
    try:
        with pytest.raises(SourceError) as err:
            src.poll()
        assert err.value.reason == reason
        assert path in str(err.value)  # the message names the endpoint
    finally:
        src.close()


def test_a_sleeping_server_is_not_woken(server) -> None:
    base, handler = server
    handler.modes["/props"] = "sleeping"
    src = LlamacppSource(_cfg(base))
    try:
        facts = src.poll().facts
        assert "/slots" not in handler.seen  # GET /slots would reload the model
        assert facts.pools == [] and facts.version == "b11434-x"
        assert facts.request_counts is not None and facts.request_counts.running == 0
    finally:
        src.close()


def test_configuration_accepts_the_kind_and_its_keys(tmp_path: Path) -> None:
    path = tmp_path / "kvledger.yml"
    path.write_text("""
engines:
  - name: llama
    kind: llamacpp
    url: http://127.0.0.1:8080
    slots_url: http://127.0.0.1:8080/slots
    kv_unified: true
    block_bytes: 32KiB
""")
    cfg = load_config(path)
    (engine,) = cfg.engines
    assert engine.option("kv_unified") == "true" and engine.option("slots_url") == "http://127.0.0.1:8080/slots"
    sources, _, _ = build_sources(cfg)
    assert any(isinstance(s, LlamacppSource) for s in sources)
    for s in sources:
        s.close()


@pytest.mark.parametrize(
    ("line", "message"),
    [("kv_unified: yes-please", "expected true or false"), ("log_file: /tmp/x.log", "log_file is for kind vllm only")],
)
def test_bad_keys_are_refused_by_name(tmp_path: Path, line: str, message: str) -> None:
    from kvledger.config.types import ConfigError

    path = tmp_path / "kvledger.yml"
    path.write_text(f"engines:\n  - name: llama\n    kind: llamacpp\n    url: http://127.0.0.1:8080\n    {line}\n")
    with pytest.raises(ConfigError, match=message):
        load_config(path)


IDLE_METRICS = (b"llamacpp:prompt_tokens_total 900\nllamacpp:prompt_tokens_cached_total 300\n"
                b"llamacpp:tokens_predicted_total 120\nllamacpp:n_decode_total 95\n"
                b"llamacpp:requests_processing 0\nllamacpp:requests_deferred 0\n")
IDLE_SLOTS = b'[{"id": 0, "n_ctx": 512, "is_processing": false, "id_task": 3, "n_prompt_tokens": 240}]'


def test_an_idle_server_is_read_from_its_last_slots_answer(server, monkeypatch) -> None:
    """/slots restarts the server's idle timer (a server polled there would never sleep):
    while /metrics shows nothing busy and no counter moving, the last answer stands."""
    base, handler = server
    monkeypatch.setitem(BODIES, "/metrics", IDLE_METRICS)
    monkeypatch.setitem(BODIES, "/slots", IDLE_SLOTS)
    src = LlamacppSource(_cfg(base))
    try:
        for _ in range(3):
            facts = src.poll().facts
            assert facts.pools[0].reclaimable == 240 and facts.pools[0].in_use == 0
        assert handler.seen.count("/slots") == 1 and handler.seen.count("/metrics") == 3
        # a request came and went: a counter moved, /slots is read again
        monkeypatch.setitem(BODIES, "/metrics", IDLE_METRICS.replace(b"n_decode_total 95", b"n_decode_total 96"))
        monkeypatch.setitem(BODIES, "/slots", IDLE_SLOTS.replace(b"240", b"250"))
        assert src.poll().facts.pools[0].reclaimable == 250
        assert handler.seen.count("/slots") == 2
        # busy (or deferred) servers are always read
        monkeypatch.setitem(BODIES, "/metrics", IDLE_METRICS.replace(b"deferred 0", b"deferred 1"))
        src.poll()
        src.poll()
        assert handler.seen.count("/slots") == 4
    finally:
        src.close()


def test_kv_size_gives_a_capped_unified_buffer(server) -> None:
    base, _ = server
    src = LlamacppSource(_cfg(base, kv_unified="true", kv_size=16384))
    try:
        assert src.poll().facts.pools[0].num_blocks == 16384
    finally:
        src.close()
    src = LlamacppSource(_cfg(base, kv_size=4096))  # split: smaller than the slots' 4 x 2048
    try:
        with pytest.raises(SourceError) as err:
            src.poll()
        assert err.value.reason == "config" and "kv_size 4096 is smaller than the slots' contexts added up (8192 tokens)" in str(err.value)
    finally:
        src.close()
