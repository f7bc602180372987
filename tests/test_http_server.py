"""The HTTP server in-process: keep-alive reuse, idle and header timeouts, a GET's body,
many connections, header size limits, every endpoint's behaviour, IPv6, TLS
certificate rotation and web-config reloads."""

from __future__ import annotations

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
