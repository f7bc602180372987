"""The HTTP server in-process: keep-alive reuse, idle and header timeouts, a GET's body,
many connections, header size limits, every endpoint's behaviour, IPv6, TLS
certificate rotation and web-config reloads."""

from __future__ import annotations

import dataclasses
import gzip
import http.client
import select
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from tls_support import bcrypt_hash, make_ca, make_leaf

from kvledger.collect.collector import Collector
from kvledger.web.connection import ServerLimits
from kvledger.web.server import KvledgerHTTPServer, basic_auth_header


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector([])
    try:
        yield c
    finally:
        c.stop()


def serve(collector: Collector, listen: str = "127.0.0.1:0", **kwargs: object) -> KvledgerHTTPServer:
    server = KvledgerHTTPServer(listen, collector, **kwargs)  # type: ignore[arg-type]
    server.start()
    return server


def raw(server: KvledgerHTTPServer) -> socket.socket:
    host, port = server.server_address
    return socket.create_connection((host, port), timeout=10)


def read_until_closed(sock: socket.socket) -> bytes:
    chunks = []
    while data := sock.recv(65536):
        chunks.append(data)
    return b"".join(chunks)


def closed_by_server(sock: socket.socket) -> bool:
    """True once the server closed the connection (recv returns EOF or a reset)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_keep_alive_connection_serves_several_requests(collector: Collector) -> None:
    collector.poll_once()
    server = serve(collector)
    try:
        host, port = server.server_address
        conn = http.client.HTTPConnection(host, port, timeout=10)
        ports = set()
        for path in ("/metrics", "/-/healthy", "/-/ready", "/", "/metrics"):
            conn.request("GET", path)
            resp = conn.getresponse()
            assert resp.status == 200 and resp.read()
            assert conn.sock is not None
            ports.add(conn.sock.getsockname()[1])
        assert len(ports) == 1  # one TCP connection carried every request
        conn.close()
    finally:
        server.stop()


def test_idle_connection_closed_after_idle_timeout(collector: Collector) -> None:
    server = serve(collector, limits=ServerLimits(idle_timeout=0.5))
    try:
        sock = raw(server)
        sock.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 OK")
        assert closed_by_server(sock)  # the 10 s socket timeout would raise instead
    finally:
        server.stop()


def test_slow_headers_are_dropped(collector: Collector) -> None:
    server = serve(collector, limits=ServerLimits(header_timeout=2.0))
    request = b"GET /-/healthy HTTP/1.1\r\nHost: slowloris\r\nUser-Agent: one byte a second\r\n\r\n"
    try:
        sock = raw(server)
        sent = 0
        dropped = False
        for byte in request:  # one byte per second
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                dropped = True
                break
            sent += 1
            readable, _, _ = select.select([sock], [], [], 1.0)
            if readable:
                data = b""
                try:
                    data = sock.recv(65536)
                except ConnectionResetError:
                    pass
                assert not data.startswith(b"HTTP/1.1 200")  # never answered
                dropped = True
                break
        assert dropped and sent < len(request)
    finally:
        server.stop()


def test_new_connection_that_sends_nothing_is_dropped(collector: Collector) -> None:
    server = serve(collector, limits=ServerLimits(header_timeout=0.5))
    try:
        assert closed_by_server(raw(server))
    finally:
        server.stop()


def test_get_with_a_body_gets_exactly_one_response(collector: Collector) -> None:
    server = serve(collector)
    smuggled = b"GET /nope HTTP/1.1\r\nHost: y\r\n\r\n"
    try:
        sock = raw(server)
        sock.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: "
                     + str(len(smuggled)).encode() + b"\r\n\r\n" + smuggled)
        data = read_until_closed(sock)
        assert data.count(b"HTTP/1.1 ") == 1
        assert data.startswith(b"HTTP/1.1 200 OK") and data.endswith(b"kvledger is healthy.\n")
        # on a kept-alive connection the body is skipped and the next real request answered
        sock = raw(server)
        sock.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: x\r\nContent-Length: " + str(len(smuggled)).encode()
                     + b"\r\n\r\n" + smuggled + b"GET /-/ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = read_until_closed(sock)
        assert data.count(b"HTTP/1.1 ") == 2 and b"404" not in data
        assert b"HTTP/1.1 503" in data  # /-/ready: no cycle yet
    finally:
        server.stop()


def test_oversized_body_refused(collector: Collector) -> None:
    server = serve(collector, limits=ServerLimits(max_body_bytes=1024))
    try:
        sock = raw(server)
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
        data = read_until_closed(sock)
        assert data.startswith(b"HTTP/1.1 413 ") and data.count(b"HTTP/1.1 ") == 1
    finally:
        server.stop()


def test_many_concurrent_connections_all_served(collector: Collector) -> None:
    server = serve(collector, limits=ServerLimits(workers=4))
    socks = []
    try:
        for _ in range(300):  # all open at once: far more than workers
            socks.append(raw(server))
        for s in socks:
            s.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answers = [read_until_closed(s) for s in socks]
        assert all(a.startswith(b"HTTP/1.1 200 OK") for a in answers)
    finally:
        for s in socks:
            s.close()
        server.stop()


def test_large_header_refused(collector: Collector) -> None:
    server = serve(collector, limits=ServerLimits(max_header_bytes=8192))
    try:
        sock = raw(server)
        sock.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n")
        data = read_until_closed(sock)
        assert data.startswith(b"HTTP/1.1 431 ") and data.count(b"HTTP/1.1 ") == 1
        sock = raw(server)  # a normal request still works
        sock.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert read_until_closed(sock).startswith(b"HTTP/1.1 200 OK")
    finally:
        server.stop()


def test_malformed_request_gets_400(collector: Collector) -> None:
    server = serve(collector)
    try:
        sock = raw(server)
        sock.sendall(b"HELLO\r\n\r\n")
        assert read_until_closed(sock).startswith(b"HTTP/1.1 400 ")
    finally:
        server.stop()


def test_endpoints(collector: Collector) -> None:
    server = serve(collector)
    try:
        host, port = server.server_address
        conn = http.client.HTTPConnection(host, port, timeout=10)

        def get(path: str, method: str = "GET", headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
            conn.request(method, path, headers=headers or {})
            resp = conn.getresponse()
            resp.body = resp.read()  # type: ignore[attr-defined]
            return resp

        assert get("/-/ready").status == 503
        collector.poll_once()
        assert get("/-/ready").status == 200
        plain = get("/metrics")
        assert plain.status == 200 and b"# TYPE kvledger_build_info gauge" in plain.body  # type: ignore[attr-defined]
        assert plain.getheader("Content-Type", "").startswith("text/plain; version=0.0.4")
        zipped = get("/metrics", headers={"Accept-Encoding": "gzip"})
        assert zipped.getheader("Content-Encoding") == "gzip"
        assert b"kvledger_build_info" in gzip.decompress(zipped.body)  # type: ignore[attr-defined]
        head = get("/metrics", "HEAD")
        assert head.status == 200 and head.body == b"" and int(head.getheader("Content-Length", "0")) > 0  # type: ignore[attr-defined]
        assert get("/api/v1/accounts").status == 404  # the JSON view is off by default
        index = get("/")
        assert index.status == 200 and b"/metrics" in index.body and b"/api/v1/accounts" not in index.body  # type: ignore[attr-defined]
        assert get("/nope").status == 404
        post = get("/metrics", "POST")
        assert post.status == 405 and post.getheader("Allow") == "GET, HEAD"
        assert get("/-/healthy").status == 200  # the connection survived all of these
    finally:
        server.stop()
    json_server = serve(collector, json_view=True)
    try:
        conn = http.client.HTTPConnection(*json_server.server_address, timeout=10)
        conn.request("GET", "/api/v1/accounts")
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("Content-Type") == "application/json" and b"metrics" in resp.read()
    finally:
        json_server.stop()


def test_ipv6_listen_address(collector: Collector) -> None:
    server = serve(collector, "[::1]:0")
    try:
        assert server.url.startswith("http://[::1]:")
        conn = http.client.HTTPConnection("::1", server.server_address[1], timeout=10)
        conn.request("GET", "/-/healthy")
        assert conn.getresponse().status == 200
    finally:
        server.stop()


def test_non_loopback_without_tls_or_auth_warns(collector: Collector, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="kvledger.web.server"):
        KvledgerHTTPServer("0.0.0.0:0", collector).stop()
        KvledgerHTTPServer("127.0.0.1:0", collector).stop()
    warnings = [r for r in caplog.records if "without TLS or basic auth" in r.getMessage()]
    assert len(warnings) == 1 and "0.0.0.0:0" in warnings[0].getMessage()


def _peer_cn(server: KvledgerHTTPServer, ca: Path) -> str:
    ctx = ssl.create_default_context(cafile=str(ca))
    host, port = server.server_address
    with socket.create_connection((host, port), timeout=10) as sock, ctx.wrap_socket(sock, server_hostname=host) as tls:
        cert = tls.getpeercert()
        assert cert is not None
        return dict(x[0] for x in cert["subject"])["commonName"]  # type: ignore[arg-type, misc]


def test_tls_certificate_rotation_and_reload(collector: Collector, tmp_path: Path) -> None:
    ca = make_ca(tmp_path, "ca")
    first = make_leaf(tmp_path, "first", ca, "IP:127.0.0.1", "serverAuth")
    second = make_leaf(tmp_path, "second", ca, "IP:127.0.0.1", "serverAuth")
    cert, key = tmp_path / "live.crt", tmp_path / "live.key"
    cert.write_bytes(first[0].read_bytes())
    key.write_bytes(first[1].read_bytes())
    web = tmp_path / "web.yml"
    web.write_text(yaml.safe_dump({"tls_server_config": {"cert_file": "live.crt", "key_file": "live.key"}}))
    server = serve(collector, web_config_file=web)
    try:
        assert server.url.startswith("https://127.0.0.1:")
        assert _peer_cn(server, ca[0]) == "first"
        cert.write_bytes(second[0].read_bytes())  # rotation: no signal, the files change
        key.write_bytes(second[1].read_bytes())
        deadline = time.monotonic() + 10
        while _peer_cn(server, ca[0]) != "second":
            assert time.monotonic() < deadline, "the rotated certificate was never served"
            time.sleep(0.2)
        # a broken new config is refused and the one in force kept
        web.write_text("tls_server_config: {cert_file: live.crt}\n")
        assert server.reload_web_config() is False
        assert _peer_cn(server, ca[0]) == "second"
        # basic auth added by a reload applies to the next request
        web.write_text(yaml.safe_dump({"tls_server_config": {"cert_file": "live.crt", "key_file": "live.key"},
                                       "basic_auth_users": {"u": bcrypt_hash("p")},
                                       "http_server_config": {"headers": {"X-Frame-Options": "deny"}}}))
        assert server.reload_web_config() is True
        ctx = ssl.create_default_context(cafile=str(ca[0]))
        conn = http.client.HTTPSConnection("127.0.0.1", server.server_address[1], context=ctx, timeout=10)
        conn.request("GET", "/-/healthy")
        resp = conn.getresponse()
        assert resp.status == 401 and resp.getheader("WWW-Authenticate") == "Basic" and resp.read()
        assert resp.getheader("X-Frame-Options") == "deny"
        conn.request("GET", "/-/healthy", headers={"Authorization": basic_auth_header("u", "p")})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.read() == b"kvledger is healthy.\n"
    finally:
        server.stop()


def test_client_allowed_sans_refuses_other_certificates(collector: Collector, tmp_path: Path) -> None:
    ca = make_ca(tmp_path, "ca")
    server_cert = make_leaf(tmp_path, "server", ca, "IP:127.0.0.1", "serverAuth")
    client_ca = make_ca(tmp_path, "client-ca")
    allowed = make_leaf(tmp_path, "allowed", client_ca, "DNS:prometheus.example", "clientAuth")
    other = make_leaf(tmp_path, "other", client_ca, "DNS:other.example", "clientAuth")
    web = tmp_path / "web.yml"
    web.write_text(yaml.safe_dump({"tls_server_config": {
        "cert_file": str(server_cert[0]), "key_file": str(server_cert[1]),
        "client_auth_type": "RequireAndVerifyClientCert", "client_ca_file": str(client_ca[0]),
        "client_allowed_sans": ["prometheus.example"]}}))
    server = serve(collector, web_config_file=web)

    def status(cert: tuple[Path, Path]) -> int:
        ctx = ssl.create_default_context(cafile=str(ca[0]))
        ctx.load_cert_chain(cert[0], cert[1])
        conn = http.client.HTTPSConnection("127.0.0.1", server.server_address[1], context=ctx, timeout=10)
        conn.request("GET", "/-/healthy")
        return conn.getresponse().status

    try:
        assert status(allowed) == 200
        with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)):
            status(other)  # signed by the client CA, but none of its SANs is allowed
    finally:
        server.stop()


# ---------------------------------------------------------------- hardening (issue 25)


def test_content_length_with_transfer_encoding_refused(collector: Collector) -> None:
    """Both framings on one request (request-smuggling hygiene): 400, one answer, closed."""
    server = serve(collector)
    try:
        for method in (b"GET", b"POST"):
            sock = raw(server)
            sock.sendall(method + b" /-/healthy HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /-/ready HTTP/1.1\r\nHost: x\r\n\r\n")
            data = read_until_closed(sock)
            assert data.startswith(b"HTTP/1.1 400 ") and data.count(b"HTTP/1.1 ") == 1, data
            assert b"both Content-Length and Transfer-Encoding" in data
        sock = raw(server)  # each alone is still fine
        sock.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
                     b"GET /-/healthy HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\nab")
        assert read_until_closed(sock).count(b"HTTP/1.1 200 OK") == 2
    finally:
        server.stop()


def test_content_length_is_ascii_digits_only() -> None:
    from kvledger.web.connection import ascii_int

    assert ascii_int("0") == 0 and ascii_int(b"0042") == 42 and ascii_int("9" * 18) == 10**18 - 1
    for bad in ("", "\u0663", "\uff13", "+3", "-3", " 3", "3 ", "3_0", "0x1", "1e3", "3.0", "9" * 19, b"\xd9\xa3", b"+3"):
        assert ascii_int(bad) is None, bad


def test_idle_connections_make_room_for_a_scraper(collector: Collector) -> None:
    """At the connection cap a new connection closes the longest-silent one instead of
    being refused; a kept-alive connection that was answered goes only after every silent one."""
    collector.poll_once()
    # the silent connections' header deadline is far beyond the scraper's 10 s socket timeout:
    # a scraper that waited for a slot to free itself would time out, not be answered
    server = serve(collector, limits=ServerLimits(max_connections=50, header_timeout=60.0))
    host, port = server.server_address
    socks: list[socket.socket] = []
    try:
        kept = http.client.HTTPConnection(host, port, timeout=10)
        kept.request("GET", "/-/healthy")
        assert kept.getresponse().read() == b"kvledger is healthy.\n"
        for _ in range(80):  # more silent connections than the cap
            socks.append(raw(server))
        for _ in range(5):
            conn = http.client.HTTPConnection(host, port, timeout=10)
            conn.request("GET", "/metrics")
            resp = conn.getresponse()
            assert resp.status == 200 and b"kvledger_build_info" in resp.read()
            conn.close()
        assert socks[0].recv(1) == b""  # the oldest silent ones were closed
        kept.request("GET", "/-/healthy")  # the answered kept-alive one was not
        assert kept.getresponse().read() == b"kvledger is healthy.\n"
        assert server.connections.open <= 50 and server.connections.evicted >= 30
    finally:
        for s in socks:
            s.close()
        server.stop()


def test_connection_cap_fits_the_open_file_limit(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import resource

    from kvledger.web import server as server_module

    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(server_module.resource, "getrlimit", lambda _r: (1024, 4096))
    monkeypatch.setattr(server_module.resource, "setrlimit", lambda _r, lim: calls.append(lim))
    limits = ServerLimits(max_connections=10_000, backlog=1024)
    # the soft limit is raised toward the hard one; the cap is what the hard one holds beside
    # the descriptors open now and one kept-alive connection per polled source
    with caplog.at_level("WARNING", logger="kvledger.web.server"):
        assert server_module.connection_cap(limits, sources=0, open_fds=20) == 4096 - 20 - server_module.FD_RESERVE
    assert calls == [(4096, 4096)] and "open-file limit 4096" in caplog.text
    monkeypatch.setattr(server_module.resource, "getrlimit", lambda _r: (1400, 1400))
    # issue 31: 1,000 engines under nofile 1,400 left room for about 400 clients, not the 700
    # announced (half the descriptors): the cap counts the sources' connections
    assert server_module.connection_cap(limits, sources=1000, open_fds=20) == 1400 - 20 - 1000 - server_module.FD_RESERVE
    assert server_module.connection_cap(limits, sources=2000, open_fds=20) == server_module.MIN_CONNECTIONS
    monkeypatch.setattr(server_module.resource, "getrlimit", lambda _r: (1024, resource.RLIM_INFINITY))
    calls.clear()
    assert server_module.connection_cap(limits, sources=5, open_fds=20) == 10_000
    assert calls == [(10_000 + 20 + 5 + server_module.FD_RESERVE, resource.RLIM_INFINITY)]


def _auth_server(collector: Collector, tmp_path: Path, **limits: object) -> KvledgerHTTPServer:
    web = tmp_path / "web.yml"
    web.write_text(yaml.safe_dump({"basic_auth_users": {"prom": bcrypt_hash("right")}}))
    return serve(collector, web_config_file=web, limits=ServerLimits(**limits))  # type: ignore[arg-type]


def _status(port: int, password: str | None, conn: http.client.HTTPConnection | None = None) -> tuple[int, http.client.HTTPResponse]:
    c = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {"Authorization": basic_auth_header("prom", password)} if password is not None else {}
    c.request("GET", "/-/healthy", headers=headers)
    resp = c.getresponse()
    resp.read()
    if conn is None:
        c.close()
    return resp.status, resp


def test_wrong_password_flood_does_not_delay_a_known_scraper(collector: Collector, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """bcrypt runs in the gate's own thread, never in the request pool: 16 clients guessing
    passwords do not make a scraper whose password is remembered wait (before: every check,
    even a remembered one, queued behind theirs in 8 workers). Here every guess's bcrypt is
    held until the scraper has been answered ten times: a remembered password that queued
    behind a guess would never be answered (its client gives up after 10 s)."""
    import secrets
    import threading

    from kvledger.web import basic_auth

    real = basic_auth.bcrypt.checkpw
    threads: set[str] = set()
    guesses_held, guess_in_bcrypt = threading.Event(), threading.Event()

    def slow(password: bytes, hashed: bytes) -> bool:
        threads.add(threading.current_thread().name)
        if password != b"right":
            guess_in_bcrypt.set()
            guesses_held.wait(30)
        return bool(real(password, hashed))

    monkeypatch.setattr(basic_auth.bcrypt, "checkpw", slow)
    server = _auth_server(collector, tmp_path, auth_failure_delay=0.05)
    port = server.server_address[1]
    stop = threading.Event()
    answers: list[int] = []

    def guess() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        while not stop.is_set():
            answers.append(_status(port, secrets.token_hex(6), conn)[0])

    flood = [threading.Thread(target=guess, daemon=True) for _ in range(16)]
    try:
        assert _status(port, "right")[0] == 200  # verified once, then remembered
        for t in flood:
            t.start()
        assert guess_in_bcrypt.wait(10)  # a guess holds the gate's thread
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        for _ in range(10):
            assert _status(port, "right", conn)[0] == 200  # answered while the guess is still held
        assert not guesses_held.is_set()
        guesses_held.set()
        deadline = time.monotonic() + 10
        while 401 not in answers:  # released, the guesses are checked and refused
            assert time.monotonic() < deadline, answers
            time.sleep(0.01)
    finally:
        guesses_held.set()
        stop.set()
        for t in flood:
            t.join(timeout=10)
        server.stop()
    assert {401, 429} <= set(answers)  # guesses were checked (one thread) and the excess refused at once
    assert threads and all(name.startswith("kvledger-bcrypt") for name in threads)


def test_refused_passwords_are_held_back_and_remembered(collector: Collector, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvledger.web import basic_auth

    calls: list[bytes] = []
    real = basic_auth.bcrypt.checkpw
    monkeypatch.setattr(basic_auth.bcrypt, "checkpw", lambda p, h: calls.append(p) or real(p, h))
    server = _auth_server(collector, tmp_path, auth_failure_delay=0.2)
    port = server.server_address[1]
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        for password in ("wrong", "wrong", "wrong", None):
            t0 = time.monotonic()
            status, resp = _status(port, password, conn)
            assert status == 401 and resp.getheader("WWW-Authenticate") == "Basic"
            assert time.monotonic() - t0 >= 0.19  # held back: a guessing client gets a few answers a second
        assert calls == [b"wrong"]  # a repeated wrong password costs one bcrypt check
        # the remembered failure locks nobody out: with refusals now held back far beyond the
        # client's 10 s timeout, the right password is still answered on the same connection
        server.limits = dataclasses.replace(server.limits, auth_failure_delay=60.0)
        assert _status(port, "right", conn)[0] == 200 and _status(port, "right", conn)[0] == 200
        assert calls == [b"wrong", b"right"]
    finally:
        server.stop()


def test_password_checks_beyond_the_gate_get_429(collector: Collector, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from kvledger.web import basic_auth

    real = basic_auth.bcrypt.checkpw
    monkeypatch.setattr(basic_auth.bcrypt, "checkpw", lambda p, h: time.sleep(0.5) or real(p, h))
    server = _auth_server(collector, tmp_path, auth_per_client=1, auth_failure_delay=0.0)
    port = server.server_address[1]
    results: list[tuple[int, str | None]] = []

    def one(i: int) -> None:
        status, resp = _status(port, f"guess-{i}")
        results.append((status, resp.getheader("Retry-After")))

    try:
        ts = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=10)
        assert sorted(results) == [(401, None), (429, "1"), (429, "1"), (429, "1")]
        assert server.auth_gate.shed == 3
    finally:
        server.stop()


def test_a_silent_connection_costs_no_task_and_keeps_its_deadline(collector: Collector) -> None:
    """A connection is made an asyncio connection only at its first byte; its first request
    must still be complete within header_timeout of the connection, not of that byte; one
    closed before sending anything frees its place."""
    server = serve(collector, limits=ServerLimits(header_timeout=3.0))
    try:
        silent = [raw(server) for _ in range(20)]
        deadline = time.monotonic() + 5
        while server.connections.open != 20:  # the server has accepted them all
            assert time.monotonic() < deadline, server.connections.open
            time.sleep(0.01)
        assert server.connections.open == 20 and len(server._silent) == 20 and not server._connections
        for s in silent[:10]:
            s.close()
        deadline = time.monotonic() + 5
        while server.connections.open != 10:
            assert time.monotonic() < deadline, server.connections.open
            time.sleep(0.05)
        late = raw(server)
        connected = time.monotonic()
        time.sleep(2.7)  # the scenario, not a wait: the first byte comes late (header_timeout 3 s)
        late.sendall(b"GET /-/healthy HTTP/1.1\r\n")  # the first byte, late; then nothing more
        assert closed_by_server(late)
        # header_timeout from the connection (closed at 3 s), not from the byte: a deadline
        # counted from the byte could not close it before 2.7 + 3 s
        assert time.monotonic() - connected < 2.7 + 3.0
        for s in silent[10:]:
            assert closed_by_server(s)  # silent ones closed after header_timeout too (never answered: EOF, not the 10 s timeout)
    finally:
        server.stop()
