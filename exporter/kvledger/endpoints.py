"""What each URL answers: /metrics, /-/healthy, /-/ready, /api/v1/accounts, the ledger page
at / (with its data at /ui/ledger.json) and the cache lab at /lab (kvledger.pages)."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry

from kvledger.collector import Collector
from kvledger.http_connection import Request, Response
from kvledger.json_view import accounts_to_json
from kvledger.pages import accounts_header, json_response, lab_response, ledger_document, page, static_response
from kvledger.prometheus_output import TEXT_CONTENT_TYPE, render_text

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
            accounts = self.collector.latest()
            body = render_text(accounts, self.process_registry)
            headers = [("Content-Type", TEXT_CONTENT_TYPE), ("Vary", "Accept-Encoding"), *accounts_header(accounts)]
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
            links = [("metrics", "/metrics"), ("-/healthy", "/-/healthy"), ("-/ready", "/-/ready")]
            if self.json_view:
                links.append(("api/v1/accounts", "/api/v1/accounts"))
            links.append(("lab", "/lab (the cache lab)"))
            return page("ledger.html", links)
        if path == "/ui/ledger.json":
            accounts = self.collector.latest()
            messages = {(h.engine, h.source): m for h, m in self.collector.health()} if self.json_view else None
            return json_response(ledger_document(accounts, self.json_view, messages), extra=accounts_header(accounts))
        if path == "/lab":
            return page("lab.html", [("./", "the ledger page"), ("metrics", "/metrics")])
        if path == "/lab/run.json":
            return lab_response(request.target)
        if path.startswith("/static/") and (static := static_response(path.removeprefix("/static/"))) is not None:
            return static
        return Response(404, b"not found\n", (("Content-Type", TEXT),))
