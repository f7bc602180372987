"""The HTTP server: /metrics, /-/healthy, /-/ready and (opt-in) /api/v1/accounts."""

from __future__ import annotations

import gzip
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


from kvledger import __version__
from kvledger.collector import Collector
from kvledger.json_view import accounts_to_json
from kvledger.prometheus_output import TEXT_CONTENT_TYPE, process_registry, render_text

log = logging.getLogger("kvledger.server")

INDEX = """<html><head><title>kvledger</title></head><body>
<h1>kvledger {version}</h1>
<p>One declared KV-cache accounting policy, exported to Prometheus.</p>
<ul><li><a href="/metrics">/metrics</a></li><li><a href="/-/healthy">/-/healthy</a></li>
<li><a href="/-/ready">/-/ready</a></li>{json}</ul></body></html>
"""


def parse_listen(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


class _Handler(BaseHTTPRequestHandler):
    server: KvledgerHTTPServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
        log.debug("%s - %s", self.address_string(), format % args)

    def _send(self, status: int, body: bytes, content_type: str, extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self) -> None:  # noqa: N802 - stdlib name
        self.do_GET()

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        path = urlsplit(self.path).path
        srv = self.server
        if path == "/metrics":
            body = render_text(srv.collector.latest(), srv.process_registry)
            content_type = TEXT_CONTENT_TYPE
            extra = {}
            if "gzip" in self.headers.get("Accept-Encoding", ""):
                body = gzip.compress(body, compresslevel=1)
                extra["Content-Encoding"] = "gzip"
            self._send(200, body, content_type, extra)
        elif path == "/-/healthy":
            self._send(200, b"kvledger is healthy.\n", "text/plain; charset=utf-8")
        elif path == "/-/ready":
            if srv.collector.ready():
                self._send(200, b"kvledger is ready.\n", "text/plain; charset=utf-8")
            else:
                self._send(503, b"kvledger is not ready: no accounting cycle has completed yet.\n", "text/plain; charset=utf-8")
        elif path == "/api/v1/accounts":
            if not srv.json_view:
                self._send(404, b"the JSON view is disabled (json_view: true in the config enables it)\n", "text/plain; charset=utf-8")
                return
            body = json.dumps(accounts_to_json(srv.collector.latest(), srv.collector), indent=1).encode()
            self._send(200, body, "application/json")
        elif path == "/":
            link = '<li><a href="/api/v1/accounts">/api/v1/accounts</a></li>' if srv.json_view else ""
            self._send(200, INDEX.format(version=__version__, json=link).encode(), "text/html; charset=utf-8")
        else:
            self._send(404, b"not found\n", "text/plain; charset=utf-8")


class KvledgerHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, listen: str, collector: Collector, json_view: bool = False, process_metrics: bool = True) -> None:
        host, port = parse_listen(listen)
        if ":" in host:
            import socket

            self.address_family = socket.AF_INET6
        super().__init__((host, port), _Handler)
        self.process_registry = process_registry() if process_metrics else None
        self.collector = collector
        self.json_view = json_view
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        name = host.decode() if isinstance(host, bytes) else host
        return f"http://{name}:{port}"

    def start(self) -> None:
        self._thread = threading.Thread(target=self.serve_forever, name="kvledger-http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
