"""The one HTTP client of the sources: an absolute deadline (slow headers included), a body
limit enforced while streaming, no redirects, no credentials or answer text in messages."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from harness.hostile import HostileEngine
from kvledger.collect.sources.base import SourceError
from kvledger.collect.sources.http_client import HttpClient, redact_url
from kvledger.domain.limits import MAX_TEXT_LINES
from kvledger_engine.document_server import serve_unix


@pytest.fixture
def engine() -> Iterator[HostileEngine]:
    server = HostileEngine(b'{"ok": true}')
    try:
        yield server
    finally:
        server.stop()


def fail(client: HttpClient) -> SourceError:
    with pytest.raises(SourceError) as info:
        client.get()
    return info.value


def test_document_is_fetched(engine: HostileEngine) -> None:
    assert HttpClient(engine.url, timeout=2).get() == b'{"ok": true}'


def test_slow_headers_end_at_the_deadline(engine: HostileEngine) -> None:
    engine.mode = "slow_headers"
    engine.drip_seconds = 0.05  # each byte well inside the per-read timeout
    err = fail(HttpClient(engine.url, timeout=0.5))
    # 200+ header bytes at 0.05 s would take over 10 s and then answer: a timeout naming the
    # 0.5 s deadline says the deadline, not the drip, ended it
    assert err.reason == "timeout"
    assert "within 0.5s" in err.message


def test_endless_body_is_too_large(engine: HostileEngine) -> None:
    engine.mode = "endless"
    err = fail(HttpClient(engine.url, timeout=10, max_bytes=4 << 20))
    assert err.reason == "too_large"
    assert str(4 << 20) in err.message


def test_declared_length_over_the_limit_is_refused_before_reading(engine: HostileEngine) -> None:
    engine.mode = "huge_length"
    err = fail(HttpClient(engine.url, timeout=2, max_bytes=1 << 20))
    assert err.reason == "too_large"
    assert "10737418240" in err.message


def test_redirect_is_not_followed_and_not_quoted(engine: HostileEngine) -> None:
    engine.mode = "redirect"
    engine.location = "http://127.0.0.1:1/private-target"
    err = fail(HttpClient(engine.url, timeout=2))
    assert err.reason == "http_status"
    assert "302" in err.message and "not followed" in err.message
    assert "private-target" not in err.message
    assert engine.requests == 1


def test_credentials_are_sent_and_never_shown(engine: HostileEngine) -> None:
    url = engine.url.replace("http://", "http://scraper:s3cret@")
    client = HttpClient(url, timeout=2)
    assert "s3cret" not in client.where and "scraper" in client.where
    engine.mode = "redirect"
    err = fail(client)
    assert "s3cret" not in err.message
    assert redact_url("https://u:p@h:1/x?y=1") == "https://u:***@h:1/x?y=1"
    assert redact_url("http://h/x") == "http://h/x"


def test_connection_refused_and_bad_urls() -> None:
    assert fail(HttpClient("http://127.0.0.1:1/x", timeout=1)).reason == "connect"
    with pytest.raises(SourceError, match="unix:///absolute/path"):
        HttpClient("unix://etc/passwd", timeout=1)
    with pytest.raises(SourceError, match="unsupported scheme"):
        HttpClient("ftp://h/x", timeout=1)


def test_unix_socket(tmp_path) -> None:  # type: ignore[no-untyped-def]
    server = serve_unix(lambda: {"schema": "kvledger/v1"}, str(tmp_path / "l.sock"))
    try:
        assert b"kvledger/v1" in HttpClient(f"unix://{tmp_path / 'l.sock'}", timeout=2).get()
    finally:
        server.stop()


def test_truncated_body_is_a_parse_error(engine: HostileEngine) -> None:
    engine.body = b"x" * 10
    engine.mode = "document"
    # a server that promises more than it sends: served by hand
    import socket

    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        conn.recv(4096)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort")
        conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    err = fail(HttpClient(f"http://127.0.0.1:{listener.getsockname()[1]}/", timeout=2))
    listener.close()
    assert err.reason == "parse" and "truncated" in err.message


def test_abort_ends_an_exchange_in_progress(engine: HostileEngine) -> None:
    engine.mode = "slow_headers"
    client = HttpClient(engine.url, timeout=30)
    errors: list[SourceError] = []

    def run() -> None:
        try:
            client.get()
        except SourceError as exc:
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 10
    while engine.requests < 1:  # the exchange is in progress: the engine has the request and drips its answer
        assert time.monotonic() < deadline, "the request never reached the engine"
        time.sleep(0.01)
    client.abort()
    t.join(timeout=5)
    assert not t.is_alive()
    assert errors and errors[0].reason in ("connect", "parse")


# ---------------------------------------------------------------- lines (issue 25): refused before the parse


def test_prometheus_text_over_the_line_limit_is_refused_while_streaming(engine: HostileEngine) -> None:
    # the probe's engine: 11 MB, 100,000 series, whose parse outlasted the 2 s deadline
    engine.body = b"".join(b'vllm:x{engine="0",v="%090d"} 1\n' % i for i in range(100_000))
    assert len(engine.body) > 11_000_000
    client = HttpClient(engine.url, timeout=10, accept="text/plain;version=0.0.4")
    assert client.max_lines == MAX_TEXT_LINES
    err = fail(client)
    assert err.reason == "too_large"
    assert err.message.endswith(f"body over the limit of {MAX_TEXT_LINES} lines (refused while it streamed in, before parsing)")


def test_the_line_limit_ends_the_read_before_the_body_does() -> None:
    """Lines past the limit, then a body that never ends: refused at once, not at the deadline."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n" + b"a 1\n" * (MAX_TEXT_LINES + 1))
            stop.wait(10)  # and then nothing, never the end

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        err = fail(HttpClient(f"http://127.0.0.1:{server.getsockname()[1]}/metrics", timeout=8, accept="text/plain"))
        assert err.reason == "too_large"  # at the deadline it would be a timeout: refused at once
    finally:
        stop.set()
        thread.join(5)
        server.close()


def test_the_line_limit_is_per_client_and_documents_have_none(engine: HostileEngine) -> None:
    engine.body = b"a 1\n" * 1000
    assert HttpClient(engine.url, timeout=5, accept="text/plain").get() == engine.body  # 1000 lines: within
    assert fail(HttpClient(engine.url, timeout=5, accept="text/plain", max_lines=999)).reason == "too_large"
    assert HttpClient(engine.url, timeout=5, accept="text/plain", max_lines=1000).get() == engine.body
    json_lines = b"[\n" + b"1,\n" * (MAX_TEXT_LINES + 1) + b"1]\n"
    engine.body = json_lines
    assert HttpClient(engine.url, timeout=5, accept="application/json").max_lines is None
    assert HttpClient(engine.url, timeout=5, accept="application/json").get() == json_lines
    assert fail(HttpClient(engine.url, timeout=5, accept="text/plain;version=0.0.4")).reason == "too_large"
