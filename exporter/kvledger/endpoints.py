"""What each URL answers: /metrics, /-/healthy, /-/ready, /api/v1/accounts and the index."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry

from kvledger import __version__
from kvledger.collector import Collector
from kvledger.http_connection import Request, Response
from kvledger.json_view import accounts_to_json
from kvledger.prometheus_output import TEXT_CONTENT_TYPE, render_text

INDEX = """<html><head><title>kvledger</title></head><body>
<h1>kvledger {version}</h1>
<p>One declared KV-cache accounting policy, exported to Prometheus.</p>
<ul><li><a href="/metrics">/metrics</a></li><li><a href="/-/healthy">/-/healthy</a></li>
<li><a href="/-/ready">/-/ready</a></li>{json}</ul></body></html>
"""

TEXT = "text/plain; charset=utf-8"


@dataclass(frozen=True)
class Endpoints:
    collector: Collector
    process_registry: CollectorRegistry | None
    json_view: bool

    def respond(self, request: Request) -> Response:
        """The response to a GET or HEAD; 405 for any other method."""
        if request.method not in ("GET", "HEAD"):
            return Response(405, b"only GET and HEAD are served\n", (("Content-Type", TEXT), ("Allow", "GET, HEAD")))
        path = urlsplit(request.target).path
        if path == "/metrics":
            body = render_text(self.collector.latest(), self.process_registry)
            headers = [("Content-Type", TEXT_CONTENT_TYPE), ("Vary", "Accept-Encoding")]
            if "gzip" in request.headers.get("accept-encoding", ""):
                body = gzip.compress(body, compresslevel=1)
                headers.append(("Content-Encoding", "gzip"))
            return Response(200, body, tuple(headers))
        if path == "/-/healthy":
            return Response(200, b"kvledger is healthy.\n", (("Content-Type", TEXT),))
        if path == "/-/ready":
            if self.collector.ready():
                return Response(200, b"kvledger is ready.\n", (("Content-Type", TEXT),))
            return Response(503, b"kvledger is not ready: no accounting cycle has completed yet.\n", (("Content-Type", TEXT),))
        if path == "/api/v1/accounts":
            if not self.json_view:
                return Response(404, b"the JSON view is disabled (json_view: true in the config enables it)\n",
                                (("Content-Type", TEXT),))
            body = json.dumps(accounts_to_json(self.collector.latest(), self.collector), indent=1).encode()
            return Response(200, body, (("Content-Type", "application/json"),))
        if path == "/":
            link = '<li><a href="/api/v1/accounts">/api/v1/accounts</a></li>' if self.json_view else ""
            return Response(200, INDEX.format(version=__version__, json=link).encode(),
                            (("Content-Type", "text/html; charset=utf-8"),))
        return Response(404, b"not found\n", (("Content-Type", TEXT),))
