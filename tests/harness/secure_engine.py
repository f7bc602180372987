"""A fake engine that demands what an engine behind a proxy or a mesh demands: a bearer
token, basic auth, and/or a client certificate (TLS with CERT_REQUIRED). It serves a
kvledger/v1 document over HTTP/1.1 with keep-alive, and records what it saw: the
connections it accepted, the Authorization headers, the client certificates' names.

    with SecureEngine(bearer="tok") as engine:           # 401 without "Authorization: Bearer tok"
    with SecureEngine(basic=("user", "pw")) as engine:    # 401 without that basic auth
    with SecureEngine(tls=pki, client_ca=pki.client_ca):  # https, a client certificate required

``drop_idle``: close every connection once its answer is sent, without saying so (no
``Connection: close``): the client's kept-alive connection is then dead when it polls next.
``stall``: seconds every answer waits. ``drop_on_request``: on a reused connection, read the request and close without an answer
(the engine closing an idle connection just as the request goes out).
"""

from __future__ import annotations

import base64
import json
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kvledger_engine.reference_ledger import Ledger, PoolSpec


def _document() -> bytes:
    led = Ledger([PoolSpec("0", 16, 4096, 64)], max_model_len=256, max_num_seqs=4)
    led.admit("r1", prompt_tokens=40, max_output_tokens=24)
    led.allocate("r1", 3)
    return json.dumps(led.to_document()).encode()


class SecureEngine:
    def __init__(self, *, bearer: str | None = None, basic: tuple[str, str] | None = None,
                 server_cert: tuple[Path, Path] | None = None, client_ca: Path | None = None) -> None:
        self.bearer = bearer
        self.basic = basic
        self.body = _document()
        self.connections = 0
        self.requests = 0
        self.authorizations: list[str | None] = []
        self.client_names: list[str] = []
        self.drop_idle = False
        self.drop_on_request = False
        self.stall = 0.0  # seconds each answer waits (a slow engine)
        self._lock = threading.Lock()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive unless the client or the answer says close

            def setup(self) -> None:
                super().setup()
                self.served = 0
                with engine._lock:
                    engine.connections += 1
                if isinstance(self.connection, ssl.SSLSocket):
                    cert = self.connection.getpeercert()
                    if cert:
                        for kind, value in cert.get("subjectAltName", ()):
                            engine.client_names.append(f"{kind}:{value}")

            def do_GET(self) -> None:
                self.served += 1
                with engine._lock:
                    engine.requests += 1
                    engine.authorizations.append(self.headers.get("Authorization"))
                if engine.drop_on_request and self.served > 1:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                time.sleep(engine.stall)
                if not engine._allowed(self.headers.get("Authorization")):
                    self._answer(401, b"unauthorized\n", {"WWW-Authenticate": 'Bearer realm="engine"'})
                    return
                self._answer(200, engine.body, {"Content-Type": "application/json"})
                if engine.drop_idle:
                    self.close_connection = True

            def _answer(self, status: int, body: bytes, headers: dict[str, str]) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.scheme = "http"
        if server_cert is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(str(server_cert[0]), str(server_cert[1]))
            if client_ca is not None:
                context.verify_mode = ssl.CERT_REQUIRED
                context.load_verify_locations(str(client_ca))
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
            self.scheme = "https"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _allowed(self, authorization: str | None) -> bool:
        if self.bearer is not None and authorization != f"Bearer {self.bearer}":
            return False
        if self.basic is not None:
            wanted = "Basic " + base64.b64encode(f"{self.basic[0]}:{self.basic[1]}".encode()).decode()
            return authorization == wanted
        return True

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}/"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> SecureEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
