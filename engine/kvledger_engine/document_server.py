"""Serve a kvledger/v1 document over HTTP (TCP) or HTTP over a Unix socket.

``serve_http(render)`` and ``serve_unix(render, path)`` start a threaded HTTP server
answering ``GET /`` (any path) with ``render()`` as JSON. The Unix-socket variant
speaks the same HTTP/1.1 on a stream socket (``unix:///path`` URLs of the ledger
source). Used by the simulator, by tests and by custom engines embedding
``kvledger_engine.reference_ledger.Ledger``.

Two optional economies, both negotiated by the reader (docs/ledger.md, "Cheaper reads"):

- conditional reads: every answer carries an ``ETag``; a GET whose ``If-None-Match`` names
  the current one is answered ``304 Not Modified`` without a body. A render may return
  ``(body, etag)`` when it knows its version (the vLLM integration does); otherwise the
  ETag is a digest of the body;
- the columnar form: given ``columns`` (a render of the same document with
  ``request_columns`` in place of ``requests``), a GET whose ``Accept`` names
  ``application/vnd.kvledger.v1.columns+json`` is answered with it. Readers that do not ask
  get the row form, as before.

``server.fault`` injects failures for tests: ``"garbage"`` (a 200 with bytes that are
not JSON), ``"status"`` (HTTP 500), ``"hang"`` (accept, then never answer until the
server stops), ``None`` (normal). A render that raises ``ValueError`` (nothing to serve
yet) is answered 503.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import socketserver
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast

Render = Callable[[], dict[str, Any] | bytes | tuple[bytes, str]]
FAULTS = (None, "garbage", "status", "hang")
#: the media type of the row form, and of the columnar form a reader may ask for
ROWS_TYPE = "application/json"
COLUMNS_TYPE = "application/vnd.kvledger.v1.columns+json"


def wants_columns(accept: str | None) -> bool:
    """Whether an Accept header asks for the columnar form (with a quality above 0)."""
    for part in (accept or "").split(","):
        media, *params = (p.strip() for p in part.split(";"))
        if media.lower() == COLUMNS_TYPE:
            return not any(p.replace(" ", "") in ("q=0", "q=0.0", "q=0.00", "q=0.000") for p in params)
    return False


def representation(result: dict[str, Any] | bytes | tuple[bytes, str], tag: str) -> tuple[bytes, str]:
    """(body, quoted ETag) of a render's result; ``tag`` tells the forms' ETags apart."""
    if isinstance(result, tuple):
        body, version = result
        return body, f'"{tag}{version}"'
    body = result if isinstance(result, bytes) else json.dumps(result, separators=(",", ":")).encode()
    return body, f'"{tag}{hashlib.blake2b(body, digest_size=12).hexdigest()}"'


def etag_matches(if_none_match: str | None, etag: str) -> bool:
    if not if_none_match:
        return False
    return any(t.strip() in (etag, f"W/{etag}", "*") for t in if_none_match.split(","))


class _Handler(BaseHTTPRequestHandler):
    server_version = "kvledger-ledger/1"
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        if self.connection.family in (socket.AF_INET, socket.AF_INET6):
            # headers and body go out in two writes: without TCP_NODELAY a kept-alive client
            # would wait for Nagle's algorithm (the body held until the headers are acknowledged)
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        cast(_Owned, self.server).owner._opened(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            cast(_Owned, self.server).owner._closed(self.connection)

    def do_GET(self) -> None:
        owner = cast(_Owned, self.server).owner  # both server classes below are _Owned
        if owner._stopping.is_set():  # stopped: a kept-alive connection gets no more answers
            self.close_connection = True
            return
        fault = owner.fault
        if fault == "hang":
            owner._stopping.wait(owner.hang_seconds)
            self.close_connection = True
            return
        if fault == "status":
            self._send(500, b'{"error": "injected failure"}')
            return
        if fault == "garbage":
            self._send(200, b"\x00this is not json{")
            return
        columns = owner.columns is not None and wants_columns(self.headers.get("Accept"))
        try:
            result = owner.columns() if columns and owner.columns is not None else owner.render()
        except ValueError as exc:
            self._send(503, json.dumps({"error": str(exc)}).encode())
            return
        body, etag = representation(result, "c" if columns else "r")
        headers = [("ETag", etag)]
        if owner.columns is not None:
            headers.append(("Vary", "Accept"))
        if etag_matches(self.headers.get("If-None-Match"), etag):
            self._send(304, b"", headers)
            return
        self._send(200, body, headers, COLUMNS_TYPE if columns else ROWS_TYPE)

    def _send(self, status: int, body: bytes, headers: list[tuple[str, str]] | None = None,
              content_type: str = ROWS_TYPE) -> None:
        self.send_response(status)
        if status != 304:
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
        for name, value in headers or ():
            self.send_header(name, value)
        self.end_headers()
        if status != 304:
            self.wfile.write(body)

    def address_string(self) -> str:  # Unix sockets have no peer address
        return str(self.client_address[0]) if self.client_address else "unix"

    def log_message(self, format: str, *args: Any) -> None:
        return


class _Owned:
    """A server that knows the LedgerServer it serves (the handler reads it)."""

    owner: LedgerServer


class _TcpServer(ThreadingHTTPServer, _Owned):
    daemon_threads = True
    block_on_close = False


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer, _Owned):
    daemon_threads = True
    block_on_close = False

    def server_bind(self) -> None:
        socketserver.UnixStreamServer.server_bind(self)
        self.server_name = "localhost"
        self.server_port = 0


class LedgerServer:
    """A running server; ``url`` is what a ledger source's config names."""

    def __init__(self, render: Render, *, host: str = "127.0.0.1", port: int = 0, unix_path: str | None = None,
                 columns: Render | None = None) -> None:
        self.render = render
        self.columns = columns
        self.fault: str | None = None
        self.hang_seconds = 60.0
        self._stopping = threading.Event()
        self._connections: set[socket.socket] = set()  # open (kept-alive) connections, ended by stop()
        self._connections_lock = threading.Lock()
        self.unix_path = unix_path
        if unix_path is not None:
            if os.path.exists(unix_path):
                os.unlink(unix_path)
            self._server: _UnixServer | _TcpServer = _UnixServer(unix_path, _Handler)
            self.url = f"unix://{unix_path}"
        else:
            tcp = _TcpServer((host, port), _Handler)
            bound_host = cast(str, tcp.server_address[0])  # an AF_INET address is (host, port)
            self.url = f"http://{bound_host}:{tcp.server_address[1]}/"
            self._server = tcp
        self._server.owner = self
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name=f"ledger-server {self.url}", daemon=True)

    def start(self) -> LedgerServer:
        self._thread.start()
        return self

    def _opened(self, conn: socket.socket) -> None:
        with self._connections_lock:
            self._connections.add(conn)

    def _closed(self, conn: socket.socket) -> None:
        with self._connections_lock:
            self._connections.discard(conn)

    def stop(self) -> None:
        """Stop listening and end every open connection (a kept-alive client sees EOF at once)."""
        self._stopping.set()
        self._server.shutdown()
        self._server.server_close()
        with self._connections_lock:
            open_connections = list(self._connections)
        for conn in open_connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed
        self._thread.join(timeout=5)
        if self.unix_path is not None and os.path.exists(self.unix_path):
            os.unlink(self.unix_path)

    def __enter__(self) -> LedgerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_http(render: Render, host: str = "127.0.0.1", port: int = 0, *, columns: Render | None = None) -> LedgerServer:
    """Start serving ``render()`` on host:port (0 = an ephemeral port); see ``.url``.
    ``columns`` renders the columnar form for readers that ask for it."""
    return LedgerServer(render, host=host, port=port, columns=columns).start()


def serve_unix(render: Render, path: str, *, columns: Render | None = None) -> LedgerServer:
    """Start serving ``render()`` as HTTP over the Unix socket ``path``; ``.url`` is ``unix://path``."""
    return LedgerServer(render, unix_path=path, columns=columns).start()
