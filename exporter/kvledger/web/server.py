"""The HTTP server: /metrics, /-/healthy, /-/ready, (opt-in) /api/v1/accounts and the pages
(kvledger.web.endpoints); with a ``responder``, any other site (`kvledger lab --serve`).

An asyncio event loop in one thread accepts connections and parks idle keep-alive ones
(they hold no thread); h11 parses requests (kvledger.web.connection); a bounded pool
of worker threads renders the responses. TLS and basic auth come from an exporter-toolkit
web config file (kvledger.web.web_config), reloaded by ``reload_web_config()`` and
whenever one of its files changes.

What an attacker cannot do to the scrapers:

- starve them with passwords: a remembered verdict (right or wrong) is answered on the
  event loop; bcrypt runs only behind the AuthGate, in its own one-thread pool at the
  lowest priority with a queue per client address, and a check the gate refuses is
  answered 429 (kvledger.web.basic_auth); every refusal (401, 429) is held back
  ``auth_failure_delay`` seconds, holding no thread, so each kept-alive connection of a
  guessing client gets at most a few answers a second;
- lock them out with connections: at ``max_connections`` a new connection closes the one
  idle longest (kvledger.web.connection.ConnectionTable). The cap is kept below the
  process' open-file limit (whose soft value is raised toward the hard one, as Go
  programs do), so accept(2) never fails for want of a descriptor. Connections are
  accepted ACCEPT_BATCH at a time, and one that has sent nothing yet costs its socket and
  a watch on it (no task, no stream): only its first byte makes it an asyncio
  connection, so a flood of silent connections is taken, and swept out after
  ``header_timeout``, cheaply.
"""

from __future__ import annotations

import asyncio
import base64
import errno
import functools
import ipaddress
import logging
import os
import resource
import socket
import ssl
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Protocol, cast
from urllib.parse import urlsplit

from kvledger.collect.collector import Collector
from kvledger.output.prometheus import process_registry
from kvledger.web.basic_auth import AuthGate, BasicAuth
from kvledger.web.connection import (
    HANDLER_ERRORS,
    ConnectionTable,
    Request,
    Response,
    ServerLimits,
    Slot,
    ascii_int,
    close_quietly,
    serve_connection,
)
from kvledger.web.endpoints import SCRAPE_PATHS, TEXT, Endpoints
from kvledger.web.lab_runs import LabRuns
from kvledger.web.runtime import WebRuntime
from kvledger.web.tls import sans_allowed

log = logging.getLogger("kvledger.web.server")


class Responder(Protocol):
    """What answers the requests of a server (called on a worker thread)."""

    def respond(self, request: Request) -> Response: ...


UNAUTHORIZED = Response(401, b"Unauthorized\n", (("Content-Type", TEXT), ("WWW-Authenticate", "Basic")))
#: a password check the AuthGate refused (too many waiting): no bcrypt was run
TOO_MANY = Response(429, b"Too many password checks waiting; retry later\n", (("Content-Type", TEXT), ("Retry-After", "1")))
#: more page or JSON-view requests waiting than ServerLimits.page_queue
PAGES_BUSY = Response(503, b"too many page requests waiting; retry later\n", (("Content-Type", TEXT), ("Retry-After", "1")))

#: descriptors kept for everything but client connections (sources, logs, files), beyond the backlog
FD_RESERVE = 256
#: connections accepted per wake-up of the event loop (others' requests are answered between batches)
ACCEPT_BATCH = 64
#: seconds accepting pauses when accept(2) fails for want of descriptors or memory
ACCEPT_RETRY_DELAY = 1.0
#: how often connections that never sent a byte are checked for their header_timeout, and
#: how many are closed at a time
SWEEP_INTERVAL = 0.5
SWEEP_BATCH = 512


def parse_listen(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    number = ascii_int(port)
    if number is None or number > 65535:
        raise ValueError(f"invalid port in listen address {listen!r}")
    return host, number


#: the fewest connections the server holds whatever the open-file limit (a scraper and a few more)
MIN_CONNECTIONS = 16
#: descriptors each polled source may hold (its kept-alive connection to the engine)
FDS_PER_SOURCE = 1


def open_descriptors() -> int:
    """The descriptors this process has open now (/proc/self/fd; 64 where it cannot be read)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 64


def connection_cap(limits: ServerLimits, sources: int = 0, open_fds: int | None = None) -> int:
    """``limits.max_connections``, or fewer when the open-file limit cannot hold them beside
    what the process holds already (``open_fds``, counted now when None), a kept-alive
    connection for each of ``sources`` polled sources, and FD_RESERVE (files, logs, a
    reload); raises the soft RLIMIT_NOFILE toward the hard one first (as the Go runtime
    does for every Go exporter). The cap is what accept(2) can take: connections past it
    close the longest-idle one (ConnectionTable), never fail for want of a descriptor."""
    used = (open_descriptors() if open_fds is None else open_fds) + sources * FDS_PER_SOURCE + FD_RESERVE
    wanted = limits.max_connections + used
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if target > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
            except (ValueError, OSError) as exc:
                log.debug("could not raise the open-file limit to %d: %s", target, exc)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return limits.max_connections
    cap = max(MIN_CONNECTIONS, soft - used)
    log.warning("open-file limit %d (hard %d) holds %d client connections, not max_connections %d (%d descriptors "
                "go to %d polled sources, files and logs); raise it (ulimit -n, LimitNOFILE=) to serve more",
                soft, hard, cap, limits.max_connections, used, sources)
    return cap


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
        #: pages and JSON views; /metrics and the probes have their own threads (_scrape_pool)
        self._pool = ThreadPoolExecutor(max_workers=self.limits.workers, thread_name_prefix="kvledger-http")
        self._scrape_pool = ThreadPoolExecutor(max_workers=self.limits.scrape_workers, thread_name_prefix="kvledger-scrape")
        self._pages_waiting = 0  # page requests queued or being answered in _pool
        #: /lab/run.json: cached, bounded, in a worker process (kvledger.web.lab_runs)
        self.lab = LabRuns(queue=self.limits.lab_queue)
        #: the open connections (on the event loop); at its cap the longest idle one is closed
        sources = len(collector.sources) if collector is not None else 0
        self.connections = ConnectionTable(connection_cap(self.limits, sources))
        #: bcrypt checks, in their own pool, queued per client
        self.auth_gate = AuthGate(self.limits.auth_workers, self.limits.auth_per_client, self.limits.auth_queue)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._accepting = False
        self._adopting: set[asyncio.Task[None]] = set()  # accepted sockets being made connections
        #: accepted connections that have sent nothing yet, oldest first: (socket, accepted at)
        self._silent: OrderedDict[Slot, tuple[socket.socket, float]] = OrderedDict()
        self._sweeper: asyncio.Handle | None = None
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

    def fit_sources(self, sources: int) -> None:
        """Hold the connections the open-file limit leaves beside ``sources`` polled sources
        (after a reload changed them): the cap announced is what accept(2) can take."""
        loop = self._loop
        limit = connection_cap(self.limits, sources)
        if loop is None:
            self.connections.limit = limit
        else:
            loop.call_soon_threadsafe(self.connections.shrink, limit)

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
        self._scrape_pool.shutdown(wait=False, cancel_futures=True)
        self.lab.close()
        self.auth_gate.close()

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
        # accept(2) here rather than asyncio.start_server, whose loop takes up to `backlog`
        # connections per wake-up and then makes them all ready at once: a burst of
        # thousands would hold the event loop for a long while; ACCEPT_BATCH at a time,
        # other connections' requests are answered between batches
        loop = asyncio.get_running_loop()
        self.socket.setblocking(False)
        self.socket.listen(self.limits.backlog)
        loop.add_reader(self.socket.fileno(), self._accept)
        self._accepting = True

    def _accept(self) -> None:
        loop = self._loop
        assert loop is not None
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _address = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                table = self.connections
                if exc.errno in (errno.EMFILE, errno.ENFILE) and MIN_CONNECTIONS < table.open <= table.limit:
                    # out of descriptors (other parts of the process took more than counted):
                    # hold fewer connections from now on, closing the longest idle to make room
                    # (their descriptors are freed as the loop turns: accepting resumes then)
                    limit = max(MIN_CONNECTIONS, table.open - ACCEPT_BATCH)
                    before = table.open
                    closed = table.shrink(limit)
                    log.error("cannot accept connections (%s) with %d open: holding at most %d from now on "
                              "(%d idle closed to make room); raise the open-file limit to serve more",
                              exc.strerror or exc, before, limit, closed)
                    if closed:
                        loop.remove_reader(self.socket.fileno())
                        loop.call_later(0.01, self._resume_accepting)
                        return
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # out of descriptors or memory: stop accepting a moment, as asyncio does
                    log.error("cannot accept connections (%s); retrying in %.0f s", exc.strerror or exc, ACCEPT_RETRY_DELAY)
                    loop.remove_reader(self.socket.fileno())
                    loop.call_later(ACCEPT_RETRY_DELAY, self._resume_accepting)
                    return
                continue  # one connection failed (ECONNABORTED ...)
            slot = self.connections.admit()
            if slot is None:  # every open connection has a request being answered
                conn.close()
                continue
            # a new connection costs a socket and a watch on it until its first byte comes
            # (a request, or a TLS ClientHello): only then is it made an asyncio connection
            conn.setblocking(False)
            slot.closer = functools.partial(self._close_silent, conn, slot)
            self._silent[slot] = (conn, loop.time())
            loop.add_reader(conn.fileno(), self._first_bytes, conn, slot)
            if self._sweeper is None:
                self._sweeper = loop.call_later(SWEEP_INTERVAL, self._sweep)

    def _resume_accepting(self) -> None:
        if self._accepting and self._loop is not None:
            self._loop.add_reader(self.socket.fileno(), self._accept)

    def _close_silent(self, conn: socket.socket, slot: Slot) -> None:
        """Close a connection that has sent nothing yet (evicted, timed out, shut down)."""
        assert self._loop is not None
        self._silent.pop(slot, None)
        if conn.fileno() >= 0:
            self._loop.remove_reader(conn.fileno())
        conn.close()
        slot.release()

    def _sweep(self) -> None:
        """Close connections silent for ``header_timeout`` seconds since they were accepted."""
        loop = self._loop
        assert loop is not None
        self._sweeper = None
        oldest = loop.time() - self.limits.header_timeout
        for _ in range(SWEEP_BATCH):
            if not self._silent:
                return
            slot, (conn, accepted) = next(iter(self._silent.items()))
            if accepted > oldest:
                break
            self._close_silent(conn, slot)
        else:  # more may be due: go on after other work
            self._sweeper = loop.call_soon(self._sweep)
            return
        self._sweeper = loop.call_later(SWEEP_INTERVAL, self._sweep)

    def _first_bytes(self, conn: socket.socket, slot: Slot) -> None:
        """A silent connection became readable: made a connection, or closed at EOF."""
        loop = self._loop
        assert loop is not None
        loop.remove_reader(conn.fileno())
        _, accepted = self._silent.pop(slot, (conn, loop.time()))
        try:
            peek = conn.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            peek = b"?"
        except OSError:
            peek = b""
        if not peek:  # closed (or reset) before sending anything
            conn.close()
            slot.release()
            return
        task = loop.create_task(self._adopt(conn, slot, accepted))
        slot.closer = task.cancel
        self._adopting.add(task)
        task.add_done_callback(self._adopting.discard)
        task.add_done_callback(functools.partial(self._adopted, conn, slot))

    def _adopted(self, conn: socket.socket, slot: Slot, task: asyncio.Task[None]) -> None:
        failed = task.cancelled() or task.exception() is not None
        if failed:
            if not task.cancelled():
                log.error("accepted connection not served", exc_info=task.exception())
            conn.close()  # a no-op when its transport closed it
            slot.release()

    async def _adopt(self, conn: socket.socket, slot: Slot, accepted: float) -> None:
        """An accepted socket, made an asyncio stream connection (``_on_connect`` is called as it is made)."""
        loop = asyncio.get_running_loop()
        limit = self.limits.max_header_bytes * 2

        def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self._on_connect(reader, writer, slot, accepted)

        def protocol() -> asyncio.StreamReaderProtocol:
            return asyncio.StreamReaderProtocol(asyncio.StreamReader(limit=limit, loop=loop), connected, loop=loop)

        try:
            await loop.connect_accepted_socket(protocol, conn)
        except OSError as exc:
            log.debug("accepted connection lost: %s", exc)
            conn.close()
            slot.release()

    async def _shutdown(self) -> None:
        assert self._loop is not None
        if self._accepting:
            self._accepting = False
            self._loop.remove_reader(self.socket.fileno())
        for slot, (conn, _) in list(self._silent.items()):
            self._close_silent(conn, slot)
        for task in [*self._adopting, *self._connections]:
            task.cancel()
        if self._connections:
            await asyncio.wait(list(self._connections), timeout=5)
        self._loop.call_soon(self._loop.stop)

    # ------------------------------------------------------------------ connections

    def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, slot: Slot, accepted: float) -> None:
        # Not a coroutine function: called as the connection is made, so reading can be paused
        # before any byte is read (a TLS ClientHello must reach the TLS layer, not the reader).
        if not slot.open:  # closed to make room meanwhile
            writer.transport.abort()
            return
        slot.closer = writer.transport.abort
        cast(asyncio.Transport, writer.transport).pause_reading()
        task = asyncio.ensure_future(self._serve(reader, writer, slot, accepted))
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)
        task.add_done_callback(lambda _t: slot.release())

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, slot: Slot, accepted: float) -> None:
        """One connection: the TLS handshake (within header_timeout of the connection), then
        its requests; the first request within header_timeout of the connection (plain) or
        of the handshake (TLS)."""
        self.web.maybe_reload()
        state = self.web.state
        deadline: float | None = accepted + self.limits.header_timeout
        try:
            if state.ssl_context is not None:
                remaining = max(0.1, accepted + self.limits.header_timeout - asyncio.get_running_loop().time())
                await writer.start_tls(state.ssl_context, ssl_handshake_timeout=remaining)
                deadline = None
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
            await serve_connection(reader, writer, self._handle, self.limits, slot, deadline)
        except (ssl.SSLError, ConnectionError, TimeoutError, OSError) as exc:
            log.debug("connection from %s ended: %s", writer.get_extra_info("peername"), exc)
            writer.transport.abort()
            await close_quietly(writer)
        except asyncio.CancelledError:
            writer.transport.abort()
            raise
        except Exception as exc:  # a bug of ours: logged (rate limited), never an unretrieved task exception
            HANDLER_ERRORS.report(exc, "connection failed")
            writer.transport.abort()
            await close_quietly(writer)

    async def _handle(self, request: Request) -> Response:
        self.web.maybe_reload()
        state = self.web.state
        loop = asyncio.get_running_loop()
        if state.auth is not None:
            denied = await self._authenticate(state.auth, request)
            if denied is not None:
                return self._with_headers(denied, state.config.headers)
        site = self.responder or self.endpoints
        assert site is not None
        path = urlsplit(request.target).path
        if request.method in ("GET", "HEAD") and path == "/lab/run.json":
            return self._with_headers(await self.lab.respond(request.target), state.config.headers)
        # a scrape between polls: the bytes already made, answered without a worker thread
        response = self.endpoints.from_memory(request) if self.endpoints is not None and self.responder is None else None
        if response is None and path in SCRAPE_PATHS:
            response = await loop.run_in_executor(self._scrape_pool, site.respond, request)
        elif response is None:
            if self._pages_waiting >= self.limits.page_queue:
                response = PAGES_BUSY
            else:
                self._pages_waiting += 1
                try:
                    response = await loop.run_in_executor(self._pool, site.respond, request)
                finally:
                    self._pages_waiting -= 1
        return self._with_headers(response, state.config.headers)

    async def _authenticate(self, auth: BasicAuth, request: Request) -> Response | None:
        """None when the request carries a valid credential, else the answer (401 or 429).
        A remembered verdict is answered here on the event loop; bcrypt only by the gate."""
        delay = self.limits.auth_failure_delay
        cred = auth.credential(request.headers.get("authorization"))
        if cred is None:
            return replace(UNAUTHORIZED, delay=delay)
        verdict = auth.remembered(cred)
        if verdict is None:
            try:
                verdict = await self.auth_gate.check(auth, cred, request.peer)
            except Exception:
                log.exception("password check failed")
                verdict = False
            if verdict is None:
                return replace(TOO_MANY, delay=delay)
        return None if verdict else replace(UNAUTHORIZED, delay=delay)

    @staticmethod
    def _with_headers(response: Response, extra: tuple[tuple[str, str], ...]) -> Response:
        if not extra:
            return response
        return Response(response.status, response.body, response.headers + extra, response.close, response.delay)


def basic_auth_header(user: str, password: str) -> str:
    """The Authorization header value for ``user``/``password`` (for clients and tests)."""
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
