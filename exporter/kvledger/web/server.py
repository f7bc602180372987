"""The HTTP server: /metrics, /-/healthy, /-/ready, (opt-in) /api/v1/accounts and the pages
(kvledger.web.endpoints); with a ``responder``, any other site (`kvledger lab --serve`).

An asyncio event loop in one thread accepts connections and parks idle keep-alive ones
(they hold no thread); h11 parses requests (kvledger.web.connection); a bounded pool
of worker threads renders the responses and checks bcrypt passwords. TLS and basic auth
come from an exporter-toolkit web config file (kvledger.web.web_config), reloaded by
``reload_web_config()`` and whenever one of its files changes.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import logging
import socket
import ssl
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol, cast

from kvledger.collect.collector import Collector
from kvledger.output.prometheus import process_registry
from kvledger.web.connection import Request, Response, ServerLimits, close_quietly, serve_connection
from kvledger.web.endpoints import TEXT, Endpoints
from kvledger.web.runtime import WebRuntime
from kvledger.web.tls import sans_allowed

log = logging.getLogger("kvledger.web.server")


class Responder(Protocol):
    """What answers the requests of a server (called on a worker thread)."""

    def respond(self, request: Request) -> Response: ...


UNAUTHORIZED = Response(401, b"Unauthorized\n", (("Content-Type", TEXT), ("WWW-Authenticate", "Basic")))


def parse_listen(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class KvledgerHTTPServer:
    """Binds ``listen`` at construction (OSError when it cannot; ConfigError for a bad
    web config); ``start()`` serves in a background thread; ``stop()`` ends it.

    It answers with the daemon's ``Endpoints`` over ``collector``, or with ``responder``
    when one is given (the collector is then unused and may be None)."""

    def __init__(self, listen: str, collector: Collector | None, json_view: bool = False, process_metrics: bool = True,
                 *, web_config_file: str | Path | None = None, limits: ServerLimits | None = None,
                 responder: Responder | None = None) -> None:
        self.limits = limits or ServerLimits()
        self.web = WebRuntime(web_config_file)
        self.collector = collector
        self.json_view = json_view
        self.process_registry = process_registry() if process_metrics and responder is None else None
        if responder is None and collector is None:
            raise ValueError("KvledgerHTTPServer needs a collector or a responder")
        #: the daemon's endpoints (None when a responder answers); replaced on reload
        self.endpoints = None if collector is None else Endpoints(collector, self.process_registry, json_view)
        self.responder = responder
        host, port = parse_listen(listen)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.create_server((host, port), family=family, backlog=self.limits.backlog)
        self.server_address: tuple[str, int] = self.socket.getsockname()[:2]
        self._pool = ThreadPoolExecutor(max_workers=self.limits.workers, thread_name_prefix="kvledger-http")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._connections: set[asyncio.Task[None]] = set()
        state = self.web.state
        if not is_loopback(host) and state.ssl_context is None and state.auth is None:
            log.warning("listening on %s without TLS or basic auth: anyone who can reach this port can read "
                        "the metrics (--web.config.file configures TLS and basic auth)", listen)

    @property
    def url(self) -> str:
        host, port = self.server_address
        scheme = "https" if self.web.state.ssl_context is not None else "http"
        name = f"[{host}]" if ":" in host else host
        return f"{scheme}://{name}:{port}"

    def reload_web_config(self) -> bool:
        """Re-read the web config file and its certificates; a bad new file is logged and
        the old configuration kept (returns False)."""
        return self.web.reload()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvledger-http", daemon=True)
        self._thread.start()
        self._started.wait()

    def stop(self) -> None:
        loop = self._loop
        if loop is not None and self._thread is not None:
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout=10)
            self._thread.join(timeout=10)
        self.socket.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._listen())
        finally:
            self._started.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._on_connect, sock=self.socket, backlog=self.limits.backlog,
                                                  limit=self.limits.max_header_bytes * 2)

    async def _shutdown(self) -> None:
        assert self._server is not None and self._loop is not None
        self._server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.wait(list(self._connections), timeout=5)
        self._loop.call_soon(self._loop.stop)

    # ------------------------------------------------------------------ connections

    def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> asyncio.Future[None] | None:
        # Not a coroutine function: called as the connection is made, so reading can be paused
        # before any byte arrives (a TLS ClientHello must reach the TLS layer, not the reader).
        if len(self._connections) >= self.limits.max_connections:
            writer.transport.abort()
            return None
        cast(asyncio.Transport, writer.transport).pause_reading()
        task = asyncio.ensure_future(self._serve(reader, writer))
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)
        return None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.web.maybe_reload()
        state = self.web.state
        try:
            if state.ssl_context is not None:
                await writer.start_tls(state.ssl_context, ssl_handshake_timeout=self.limits.header_timeout)
                tls = state.config.tls
                assert tls is not None
                if not sans_allowed(tls, writer.get_extra_info("peercert")):
                    log.info("client certificate from %s has none of client_allowed_sans; closing",
                             writer.get_extra_info("peername"))
                    writer.transport.abort()
                    await close_quietly(writer)
                    return
            else:
                cast(asyncio.Transport, writer.transport).resume_reading()
            await serve_connection(reader, writer, self._handle, self.limits)
        except (ssl.SSLError, ConnectionError, TimeoutError, OSError) as exc:
            log.debug("connection from %s ended: %s", writer.get_extra_info("peername"), exc)
            writer.transport.abort()
            await close_quietly(writer)
        except asyncio.CancelledError:
            writer.transport.abort()
            raise

    async def _handle(self, request: Request) -> Response:
        self.web.maybe_reload()
        state = self.web.state
        loop = asyncio.get_running_loop()
        if state.auth is not None:
            auth = state.auth
            header = request.headers.get("authorization")
            if not await loop.run_in_executor(self._pool, auth.check, header):
                return self._with_headers(UNAUTHORIZED, state.config.headers)
        site = self.responder or self.endpoints
        assert site is not None
        # a scrape between polls: the bytes already made, answered without a worker thread
        response = self.endpoints.from_memory(request) if self.endpoints is not None and self.responder is None else None
        if response is None:
            response = await loop.run_in_executor(self._pool, site.respond, request)
        return self._with_headers(response, state.config.headers)

    @staticmethod
    def _with_headers(response: Response, extra: tuple[tuple[str, str], ...]) -> Response:
        if not extra:
            return response
        return Response(response.status, response.body, response.headers + extra, response.close)


def basic_auth_header(user: str, password: str) -> str:
    """The Authorization header value for ``user``/``password`` (for clients and tests)."""
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
