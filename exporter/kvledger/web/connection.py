"""One HTTP/1.1 connection: h11 parses and frames, asyncio streams carry the bytes.

A connection waiting for its next request holds no thread (the event loop parks it);
the server's limits apply here:

- the first request on a connection, and every request once its first byte arrived,
  must be complete (headers and body) within ``header_timeout`` seconds (slowloris);
- a kept-alive connection with no new request for ``idle_timeout`` seconds is closed;
- request headers above ``max_header_bytes`` get 431, a body above ``max_body_bytes``
  413, malformed requests 400, each followed by closing the connection;
- a request's body (a GET may carry one) is read and discarded, never parsed as a
  request; ``Expect: 100-continue`` is answered;
- each response goes out in one write (headers and body together, TCP_NODELAY is
  asyncio's default), so a keep-alive request never waits on Nagle and delayed ACKs;
- a response not taken by the client within ``write_timeout`` seconds closes it;
- a response with a ``delay`` (a refused password) is held back that long, the
  connection holding no thread meanwhile: a client guessing on a kept-alive connection
  gets at most 1/delay answers a second;
- a request with both Content-Length and Transfer-Encoding gets 400 (request-smuggling
  hygiene: the two framings could be read differently by a proxy in front);
- numbers read from a request (Content-Length here, query parameters in the pages) are
  ASCII digits only (``ascii_int``): ``int()`` would also take signs, spaces, underscores
  and other scripts' digits.

At most ``max_connections`` are open (``ConnectionTable``): at the cap a new connection
closes the one that has waited longest with no request being answered, so idle or silent
connections can never lock a scraper out; only a connection whose request is being
answered is never closed to make room.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus

import h11

log = logging.getLogger("kvledger.web.server")

READ_CHUNK = 65536


@dataclass(frozen=True)
class ServerLimits:
    """Limits of the HTTP server (seconds, bytes, counts)."""

    #: a kept-alive connection with no request is closed after this; longer than the
    #: longest usual scrape interval (60 s) so Prometheus' connection is reused
    idle_timeout: float = 120.0
    #: a request (line, headers and body) must arrive within this from its first byte
    header_timeout: float = 10.0
    write_timeout: float = 30.0
    max_header_bytes: int = 16 * 1024
    max_body_bytes: int = 64 * 1024
    #: threads answering pages and JSON views; idle connections hold none
    workers: int = 8
    #: threads of /metrics, /-/healthy and /-/ready alone (a render after each cycle): no
    #: page, JSON view or lab run ever waits in front of a scrape
    scrape_workers: int = 2
    #: page and JSON-view requests waiting or being answered; more are answered 503
    page_queue: int = 64
    #: distinct /lab/run.json runs waiting or running (one worker process); more are answered 503
    lab_queue: int = 4
    #: listen(2) backlog (the kernel caps it at net.core.somaxconn)
    backlog: int = 1024
    #: open connections; at this many a new one closes the longest-idle one (ConnectionTable)
    #: and is refused only when every open connection has a request being answered
    max_connections: int = 10_000
    #: threads checking bcrypt passwords (their own pool, kvledger.web.basic_auth.AuthGate)
    auth_workers: int = 1
    #: bcrypt checks one client address may have waiting or running; more are answered 429
    auth_per_client: int = 4
    #: bcrypt checks waiting in all; more are answered 429
    auth_queue: int = 256
    #: seconds a refused password's answer (401, 429) is held back (no thread is held)
    auth_failure_delay: float = 0.25


@dataclass(frozen=True)
class Request:
    method: str
    target: str
    #: lower-case names; a repeated header's values joined with ", "
    headers: dict[str, str]
    #: the client's address (IP), "" when unknown
    peer: str = ""


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()
    close: bool = False
    #: seconds to hold the response back (a refused password: the client's next try waits,
    #: and the connection holds no thread meanwhile)
    delay: float = 0.0


Handler = Callable[[Request], Awaitable[Response]]

#: the most digits ``ascii_int`` reads (every number a request may carry fits)
MAX_DIGITS = 18


def ascii_int(text: str | bytes) -> int | None:
    """A non-negative decimal integer of ASCII digits only (1 to MAX_DIGITS of them), or
    None: no sign, space, underscore or other script's digits, all of which ``int()``
    takes (``int("\u0663") == 3``)."""
    if not 0 < len(text) <= MAX_DIGITS or not text.isascii() or not text.isdigit():
        return None
    return int(text)


class ErrorLog:
    """Errors of request handlers, logged once per kind (the exception's type and the line
    that raised it) with its traceback, then at most once per ``interval`` seconds per
    kind with the count since: a client that triggers one at every request cannot fill
    the log. At most ``kinds`` kinds are remembered (the oldest forgotten first)."""

    def __init__(self, interval: float = 60.0, kinds: int = 64) -> None:
        self.interval = interval
        self.kinds = kinds
        self._seen: OrderedDict[tuple[str, str], tuple[float, int]] = OrderedDict()  # kind -> (logged at, not logged since)
        self.total = 0

    @staticmethod
    def kind(exc: BaseException) -> tuple[str, str]:
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        where = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else "?"
        return type(exc).__qualname__, where

    def report(self, exc: BaseException, what: str = "request handler failed") -> bool:
        """Log ``exc`` unless its kind was logged less than ``interval`` seconds ago; True if logged."""
        self.total += 1
        key = self.kind(exc)
        now = time.monotonic()
        seen = self._seen.get(key)
        if seen is not None and now - seen[0] < self.interval:
            self._seen[key] = (seen[0], seen[1] + 1)
            return False
        if seen is None:
            log.error("%s: %s: %s", what, key[0], exc, exc_info=exc)
        else:
            log.error("%s: %s: %s (%d more of this kind in the last %.0f s, not logged)", what, key[0], exc,
                      seen[1], now - seen[0])
        self._seen[key] = (now, 0)
        self._seen.move_to_end(key)
        while len(self._seen) > self.kinds:
            self._seen.popitem(last=False)
        return True


#: the errors of every server's handlers (one log budget for the process)
HANDLER_ERRORS = ErrorLog()

INTERNAL_ERROR = Response(500, b"internal error while answering this request (logged by the daemon)\n",
                          (("Content-Type", "text/plain; charset=utf-8"),), close=True)


class Slot:
    """One open connection's place in a ConnectionTable; ``closer`` closes the connection
    at once (set by whoever holds it now: the raw socket's, then the transport's abort)."""

    __slots__ = ("_table", "closer", "open")

    def __init__(self, table: ConnectionTable) -> None:
        self._table = table
        self.closer: Callable[[], object] | None = None
        self.open = True

    def busy(self) -> None:
        """A request is being answered: never closed to make room."""
        self._table._new.pop(self, None)
        self._table._kept.pop(self, None)

    def waiting(self) -> None:
        """The response is held back (a refused password) or written and not yet taken by
        the client: the connection may be closed to make room, as a silent one may."""
        if self.open:
            self._table._new[self] = None

    def idle(self) -> None:
        """Answered; waiting for the next request (kept alive)."""
        if self.open:
            self._table._new.pop(self, None)
            self._table._kept[self] = None
            self._table._kept.move_to_end(self)

    def release(self) -> None:
        """The connection is closed (idempotent)."""
        if self.open:
            self.open = False
            self.busy()
            self._table.open -= 1

    def evict(self) -> None:
        self.release()
        if self.closer is not None:
            self.closer()


class ConnectionTable:
    """The open connections of a server, at most ``limit``, each with its Slot; on the
    event loop only. At the limit, ``admit`` closes one to make room: first the one open
    longest that never had a request answered (silent, or still sending its first
    request), else the kept-alive one idle longest; a connection with a request being
    answered is never closed (one whose response is held back or not taken by its client
    is), and when every one has, the new connection is refused."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0
        self.evicted = 0  # connections closed to make room
        self.refused = 0  # new connections refused: every open one busy
        self._new: OrderedDict[Slot, None] = OrderedDict()  # no request answered yet (or a response not taken), oldest first
        self._kept: OrderedDict[Slot, None] = OrderedDict()  # kept alive, least recently answered first

    def admit(self) -> Slot | None:
        """A Slot for a new connection (closing another when at the limit); None: refuse it.
        The caller sets its ``closer`` before anything else may run."""
        if self.open >= self.limit:
            victims = self._new or self._kept
            if not victims:
                self.refused += 1
                return None
            victim, _ = victims.popitem(last=False)
            victim.evict()
            self.evicted += 1
        slot = Slot(self)
        self.open += 1
        self._new[slot] = None
        return slot

    def shrink(self, limit: int) -> int:
        """Hold at most ``limit`` from now on, closing (as ``admit`` would) connections
        over it that may be closed; returns how many were closed."""
        self.limit = limit
        closed = 0
        while self.open > limit and (victims := self._new or self._kept):
            victim, _ = victims.popitem(last=False)
            victim.evict()
            self.evicted += 1
            closed += 1
        return closed


class _DateCache:
    """The Date header, formatted once a second."""

    def __init__(self) -> None:
        self._second = -1
        self._value = ""

    def now(self) -> str:
        second = int(time.time())
        if second != self._second:
            self._second, self._value = second, formatdate(second, usegmt=True)
        return self._value


_date = _DateCache()


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


def _error_bytes(status: int, message: str) -> bytes:
    """A complete error response closing the connection, written without h11 (the
    request it answers may never have been parsed)."""
    body = f"{message}\n".encode()
    return (f"HTTP/1.1 {status} {_reason(status).decode()}\r\n"
            f"Date: {_date.now()}\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


class _Reject(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def _read_request(conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        limits: ServerLimits, first: bool, peer: str = "", first_deadline: float | None = None) -> Request | None:
    """The next complete request (its body read and dropped); None when the client
    closed or a timeout expired; _Reject for a request refused with a status."""
    loop = asyncio.get_running_loop()
    started = first or bool(conn.trailing_data[0])
    deadline = loop.time() + (limits.header_timeout if started else limits.idle_timeout)
    if first and first_deadline is not None:
        deadline = first_deadline
    request: h11.Request | None = None
    body = 0
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            status = exc.error_status_hint
            if status == 431:
                raise _Reject(431, f"request headers larger than {limits.max_header_bytes} bytes") from None
            raise _Reject(status, f"bad request: {exc}") from None
        if event is h11.NEED_DATA:
            try:
                async with asyncio.timeout_at(deadline):
                    data = await reader.read(READ_CHUNK)
            except TimeoutError:
                if started:
                    log.debug("request not complete within %.1f s; closing", limits.header_timeout)
                return None
            if not started and data:
                started = True
                deadline = loop.time() + limits.header_timeout
            conn.receive_data(data)
        elif isinstance(event, h11.Request):
            request = event
            # h11 bounds only an incomplete head; a complete one that arrived in one read is measured here
            size = len(event.target) + sum(len(k) + len(v) + 4 for k, v in event.headers)
            if size > limits.max_header_bytes:
                raise _Reject(431, f"request headers larger than {limits.max_header_bytes} bytes")
            names = {name for name, _ in event.headers}
            if b"content-length" in names and b"transfer-encoding" in names:
                raise _Reject(400, "bad request: both Content-Length and Transfer-Encoding")
            length = dict(event.headers).get(b"content-length")
            if length is not None and ((n := ascii_int(length)) is None or n > limits.max_body_bytes):
                raise _Reject(413, f"request body larger than {limits.max_body_bytes} bytes")
            if conn.client_is_waiting_for_100_continue:
                writer.write(conn.send(h11.InformationalResponse(status_code=100, headers=[])) or b"")
        elif isinstance(event, h11.Data):
            body += len(event.data)
            if body > limits.max_body_bytes:
                raise _Reject(413, f"request body larger than {limits.max_body_bytes} bytes")
        elif isinstance(event, h11.EndOfMessage):
            assert request is not None
            headers: dict[str, str] = {}
            for name, value in request.headers:
                key = name.decode("latin-1")
                text = value.decode("latin-1")
                headers[key] = f"{headers[key]}, {text}" if key in headers else text
            return Request(request.method.decode("ascii"), request.target.decode("latin-1"), headers, peer)
        else:  # ConnectionClosed
            return None


def _response_bytes(conn: h11.Connection, response: Response, head: bool) -> bytes:
    headers = [("Date", _date.now()), *response.headers, ("Content-Length", str(len(response.body)))]
    if response.close:
        headers.append(("Connection", "close"))
    out = conn.send(h11.Response(status_code=response.status, headers=headers, reason=_reason(response.status)))
    if response.body and not head:
        out += conn.send(h11.Data(data=response.body))
    out += conn.send(h11.EndOfMessage())
    return out


async def serve_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handle: Handler,
                           limits: ServerLimits, slot: Slot | None = None, first_deadline: float | None = None) -> None:
    """Answer requests on one connection until it closes, errs or times out; ``slot``
    (its place in the server's ConnectionTable) is told when a request is being answered;
    the first request must be complete by ``first_deadline`` (event-loop time) when given,
    else within ``header_timeout``."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_header_bytes)
    peername = writer.get_extra_info("peername")
    peer = str(peername[0]) if isinstance(peername, tuple) and peername else ""
    first = True
    try:
        while True:
            try:
                request = await _read_request(conn, reader, writer, limits, first, peer, first_deadline)
            except _Reject as rej:
                writer.write(_error_bytes(rej.status, str(rej)))
                async with asyncio.timeout(limits.write_timeout):
                    await writer.drain()
                return
            first = False
            if request is None:
                return
            if slot is not None:
                slot.busy()
            try:
                response = await handle(request)
            except (asyncio.CancelledError, ConnectionError):
                raise
            except Exception as exc:  # a bug of ours: answered 500, logged once per kind (rate limited)
                HANDLER_ERRORS.report(exc)
                response = INTERNAL_ERROR
            if response.delay > 0:
                if slot is not None:
                    slot.waiting()
                await asyncio.sleep(response.delay)
            writer.write(_response_bytes(conn, response, request.method == "HEAD"))
            if slot is not None and writer.transport.get_write_buffer_size():
                slot.waiting()
            async with asyncio.timeout(limits.write_timeout):
                await writer.drain()
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            conn.start_next_cycle()
            if slot is not None:
                slot.idle()
    except (ConnectionError, TimeoutError, OSError, h11.ProtocolError) as exc:
        log.debug("connection ended: %s", exc)
    except Exception as exc:  # never an unretrieved task exception: logged (rate limited), connection closed
        HANDLER_ERRORS.report(exc, "connection failed")
    finally:
        await close_quietly(writer)


async def close_quietly(writer: asyncio.StreamWriter) -> None:
    """Close and wait for the close, taking any connection error (a reset) with it so
    asyncio never reports it as unretrieved."""
    writer.close()
    with contextlib.suppress(Exception):
        async with asyncio.timeout(1.0):
            await writer.wait_closed()
