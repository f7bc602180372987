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
- a response not taken by the client within ``write_timeout`` seconds closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
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
    #: threads answering requests (rendering /metrics, bcrypt); idle connections hold none
    workers: int = 8
    #: listen(2) backlog (the kernel caps it at net.core.somaxconn)
    backlog: int = 1024
    #: connections beyond this are closed at once
    max_connections: int = 10_000


@dataclass(frozen=True)
class Request:
    method: str
    target: str
    #: lower-case names; a repeated header's values joined with ", "
    headers: dict[str, str]


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()
    close: bool = False


Handler = Callable[[Request], Awaitable[Response]]


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
                        limits: ServerLimits, first: bool) -> Request | None:
    """The next complete request (its body read and dropped); None when the client
    closed or a timeout expired; _Reject for a request refused with a status."""
    loop = asyncio.get_running_loop()
    started = first or bool(conn.trailing_data[0])
    deadline = loop.time() + (limits.header_timeout if started else limits.idle_timeout)
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
            length = dict(event.headers).get(b"content-length")
            if length is not None and length.isdigit() and int(length) > limits.max_body_bytes:
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
            return Request(request.method.decode("ascii"), request.target.decode("latin-1"), headers)
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
                           limits: ServerLimits) -> None:
    """Answer requests on one connection until it closes, errs or times out."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_header_bytes)
    first = True
    try:
        while True:
            try:
                request = await _read_request(conn, reader, writer, limits, first)
            except _Reject as rej:
                writer.write(_error_bytes(rej.status, str(rej)))
                async with asyncio.timeout(limits.write_timeout):
                    await writer.drain()
                return
            first = False
            if request is None:
                return
            response = await handle(request)
            writer.write(_response_bytes(conn, response, request.method == "HEAD"))
            async with asyncio.timeout(limits.write_timeout):
                await writer.drain()
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            conn.start_next_cycle()
    except (ConnectionError, TimeoutError, OSError, h11.ProtocolError) as exc:
        log.debug("connection ended: %s", exc)
    finally:
        await close_quietly(writer)


async def close_quietly(writer: asyncio.StreamWriter) -> None:
    """Close and wait for the close, taking any connection error (a reset) with it so
    asyncio never reports it as unretrieved."""
    writer.close()
    with contextlib.suppress(Exception):
        async with asyncio.timeout(1.0):
            await writer.wait_closed()
