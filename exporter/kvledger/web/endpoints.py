"""What each URL answers: /metrics, /-/healthy, /-/ready, /api/v1/accounts, the ledger page
at / (with its data at /ui/ledger.json) and the cache lab at /lab (kvledger.web.pages).

/metrics is served from memory (``MetricsBody``): the body is rendered at most once per new
Accounts and exposition format, by the first scrape after an accounting cycle that asks for
that format (the text format, or OpenMetrics when the Accept header asks for it, as
prometheus_client negotiates), and its gzip form at most once too, by the first scrape that
accepts gzip (Prometheus does); every other scrape until the next cycle writes the bytes
already made. The exporter's own process figures (CPU, RSS)
are read with that render, so they are as old as the Accounts they come with (at most one
poll interval).
"""

from __future__ import annotations

import gzip
import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry

from kvledger.collect.collector import Collector
from kvledger.domain.accounts import Accounts
from kvledger.output.json_view import accounts_to_json
from kvledger.output.prometheus import OPENMETRICS, negotiate, render
from kvledger.output.prometheus import TEXT as TEXT_FORMAT
from kvledger.web.connection import Request, Response
from kvledger.web.pages import accounts_header, json_response, lab_response, ledger_page_data, page, static_response

TEXT = "text/plain; charset=utf-8"
#: the paths answered from the scrapers' own threads (never behind a page, a JSON view or a lab run)
SCRAPE_PATHS = frozenset({"/metrics", "/-/healthy", "/-/ready"})


def _metrics_headers(content_type: str, gzipped: bool) -> tuple[tuple[str, str], ...]:
    headers = (("Content-Type", content_type), ("Vary", "Accept, Accept-Encoding"))
    return (*headers, ("Content-Encoding", "gzip")) if gzipped else headers


class MetricsBody:
    """The /metrics bodies of the latest Accounts, one per exposition format asked for
    (the text format, OpenMetrics), each rendered once and kept with its gzip form."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._accounts: Accounts | None = None
        self._rendered = False
        self._bodies: dict[str, bytes] = {}  # format -> body, for self._accounts
        self._gzips: dict[str, bytes] = {}  # format -> gzip form of its body
        self.renders = 0  # bodies rendered (at most one per Accounts and format)
        self.compressions = 0  # gzip forms made (at most one per body)
        self.served = 0  # /metrics answers
        self.served_gzip = 0  # of which gzip
        self.served_openmetrics = 0  # of which OpenMetrics

    def get(self, accounts: Accounts | None, process_registry: CollectorRegistry | None, gzipped: bool,
            fmt: str = TEXT_FORMAT) -> bytes:
        """The body for ``accounts`` in ``fmt`` (gzip-compressed when ``gzipped``), made once per Accounts."""
        with self._lock:  # concurrent scrapes after a cycle: one renders, the others wait for its bytes
            if not self._rendered or accounts is not self._accounts:
                self._accounts, self._rendered, self._bodies, self._gzips = accounts, True, {}, {}
            body = self._bodies.get(fmt)
            if body is None:
                body = self._bodies[fmt] = render(accounts, process_registry, fmt)
                self.renders += 1
            self._count(gzipped, fmt)
            if not gzipped:
                return body
            zipped = self._gzips.get(fmt)
            if zipped is None:
                zipped = self._gzips[fmt] = gzip.compress(body, compresslevel=1, mtime=0)
                self.compressions += 1
            return zipped

    def _count(self, gzipped: bool, fmt: str) -> None:
        self.served += 1
        self.served_gzip += gzipped
        self.served_openmetrics += fmt == OPENMETRICS

    def ready(self, accounts: Accounts | None, gzipped: bool, fmt: str = TEXT_FORMAT) -> bytes | None:
        """The bytes already made for ``accounts`` in ``fmt`` (None when a render or a
        compression is due, or another scrape is making them): never waits, for the event loop."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if not self._rendered or accounts is not self._accounts:
                return None
            body = (self._gzips if gzipped else self._bodies).get(fmt)
            if body is not None:
                self._count(gzipped, fmt)
            return body
        finally:
            self._lock.release()


#: an Accept-Encoding weight (RFC 9110 §12.4.2), ASCII digits only
_QVALUE = re.compile(r"(?:0(?:\.[0-9]{0,3})?|1(?:\.0{0,3})?)", re.ASCII)


def accepts_gzip(header: str) -> bool:
    """Whether an Accept-Encoding header accepts gzip: named without a weight, or with a
    weight above zero; a malformed weight is read as a refusal (plain text is always served)."""
    for part in header.split(","):
        coding, *params = (p.strip() for p in part.split(";"))
        if coding.lower() in ("gzip", "x-gzip"):
            for param in params:
                name, _, value = (x.strip() for x in param.partition("="))
                if name.lower() == "q":
                    return _QVALUE.fullmatch(value) is not None and value.strip("0.") != ""
            return True
    return False


class ViewCache:
    """The JSON views (/api/v1/accounts, /ui/ledger.json) of the latest Accounts, each made
    once per accounting cycle: a client asking for them in a loop costs a dictionary lookup."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._accounts: Accounts | None = None
        self._made = False
        self._responses: dict[str, Response] = {}
        self.made = 0

    def get(self, accounts: Accounts | None, path: str, make: Callable[[], Response]) -> Response:
        with self._lock:
            if not self._made or accounts is not self._accounts:
                self._accounts, self._made, self._responses = accounts, True, {}
            response = self._responses.get(path)
            if response is None:
                response = self._responses[path] = make()
                self.made += 1
            return response


def _reader(request: Request) -> str:
    """Who reads /metrics, for the collector to learn its cadence (``ReadCadence``): the
    client's address (a Prometheus server scrapes a target from one address)."""
    return f"metrics {request.peer}"


@dataclass(frozen=True)
class Endpoints:
    collector: Collector
    process_registry: CollectorRegistry | None
    json_view: bool
    metrics: MetricsBody = field(default_factory=MetricsBody)
    views: ViewCache = field(default_factory=ViewCache)

    def from_memory(self, request: Request) -> Response | None:
        """A /metrics answer when its bytes are already made (a buffer write, no thread),
        else None: ``respond`` then renders it in a worker thread."""
        if request.method not in ("GET", "HEAD") or urlsplit(request.target).path != "/metrics":
            return None
        gzipped = accepts_gzip(request.headers.get("accept-encoding", ""))
        fmt, content_type = negotiate(request.headers.get("accept", ""))
        accounts = self.collector.made()  # never made here: the event loop does not account
        body = self.metrics.ready(accounts, gzipped, fmt) if accounts is not None else None
        if body is None:
            return None
        self.collector.read_by(_reader(request))
        return Response(200, body, (*_metrics_headers(content_type, gzipped), *accounts_header(accounts)))

    def respond(self, request: Request) -> Response:
        """The response to a GET or HEAD; 405 for any other method."""
        if request.method not in ("GET", "HEAD"):
            return Response(405, b"only GET and HEAD are served\n", (("Content-Type", TEXT), ("Allow", "GET, HEAD")))
        path = urlsplit(request.target).path
        if path == "/metrics":
            accounts = self.collector.latest(_reader(request))
            gzipped = accepts_gzip(request.headers.get("accept-encoding", ""))
            fmt, content_type = negotiate(request.headers.get("accept", ""))
            body = self.metrics.get(accounts, self.process_registry, gzipped, fmt)
            return Response(200, body, (*_metrics_headers(content_type, gzipped), *accounts_header(accounts)))
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
            latest = self.collector.latest()

            def accounts_view() -> Response:
                body = json.dumps(accounts_to_json(latest, self.collector.health()), indent=1).encode()
                return Response(200, body, (("Content-Type", "application/json"),))

            return self.views.get(latest, path, accounts_view)  # only with json_view on
        if path == "/":
            links = [("metrics", "/metrics"), ("-/healthy", "/-/healthy"), ("-/ready", "/-/ready")]
            if self.json_view:
                links.append(("api/v1/accounts", "/api/v1/accounts"))
            links.append(("lab", "/lab (the cache lab)"))
            return page("ledger.html", links)
        if path == "/ui/ledger.json":
            accounts = self.collector.latest()

            def ledger_view() -> Response:
                messages = {(h.engine, h.source): m for h, m in self.collector.health()} if self.json_view else None
                return json_response(ledger_page_data(accounts, self.json_view, messages), extra=accounts_header(accounts))

            return self.views.get(accounts, f"{path} json_view={self.json_view}", ledger_view)
        if path == "/lab":
            return page("lab.html", [("./", "the ledger page"), ("metrics", "/metrics")])
        if path == "/lab/run.json":
            return lab_response(request.target)
        if path.startswith("/static/") and (static := static_response(path.removeprefix("/static/"))) is not None:
            return static
        return Response(404, b"not found\n", (("Content-Type", TEXT),))
