"""The one HTTP client of every source: a GET bounded in time and in size.

``HttpClient(url, timeout=..., max_bytes=...).get()`` returns the body or raises
``SourceError`` with a bounded reason:

- ``connect``: no connection (refused, unreachable, reset, TLS handshake failed);
- ``timeout``: the whole exchange (connect, status line, headers, body) did not end
  within ``timeout`` seconds. The deadline is absolute: an engine that drips its headers
  one byte a second cannot keep the poll waiting, because a watchdog thread shuts the
  socket down when the deadline passes, whatever the read in progress is doing;
- ``http_status``: an answer other than 200 (redirects are not followed: a 3xx is an
  error naming the status, never a fetch of another address); ``fetch(if_none_match=...)``
  also takes 304 Not Modified, the answer to a conditional GET whose ETag still holds;
- ``too_large``: the body passed ``max_bytes`` (checked against Content-Length before
  reading, and while streaming, so at most ``max_bytes`` plus one chunk is ever held), or
  ``max_lines`` lines (counted while streaming, before anything parses it: a client that
  asks for ``text/plain``, a Prometheus text, is held to ``MAX_TEXT_LINES`` unless told
  otherwise, since parsing outlasts a poll's deadline long before 16 MiB);
- ``parse``: not HTTP (bad status line, too many or too long header lines, truncated body).

URLs are ``http://``, ``https://`` or ``unix:///absolute/path`` (HTTP/1.1 over a Unix
socket, ``GET /``). Credentials in a URL (``http://user:pass@host``) are sent as basic
auth and never appear in a message: ``redact_url`` removes them. Messages never quote
the body or any header of the answer.

An engine's ``authorization``, ``basic_auth`` and ``tls_config`` (``ClientAuth``, the keys of
Prometheus' scrape_config) are presented on every request: a ``credentials_file`` or
``password_file`` is read at each request (a rotated token is used at once; unreadable:
reason ``config``, naming the key and the file, never its content), the TLS files when a
connection opens, again whenever one of them changed. A 401 or 403 answer says the engine
refused the credentials, never which ones.

Connections are kept alive between polls (HTTP/1.1): one idle connection per client,
reused by the next GET unless the engine closed it meanwhile (seen before sending: the
socket is readable at EOF) or closes it as the request goes out (the reused connection
fails before any answer: the GET is sent once more on a new connection, within the same
deadline). A connection that ended in any error, or that the answer asked to close, is
not kept.
"""

from __future__ import annotations

import base64
import heapq
import http.client
import itertools
import os
import re
import select
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit, urlunsplit

from kvledger.collect import poll_budget
from kvledger.collect.memory import release_freed_memory
from kvledger.collect.sources.base import SourceError
from kvledger.config.engine_tls import client_ssl_context
from kvledger.config.files import MAX_SECRET_FILE_BYTES, read_secret_file  # noqa: F401  # re-exported here
from kvledger.config.types import ClientAuth, TlsClientConfig
from kvledger.domain.limits import MAX_TEXT_LINES

#: default cap on a response body (engines' documents and /metrics texts); per engine
#: ``max_response_bytes`` in the configuration overrides it
DEFAULT_MAX_BYTES = 16 << 20
_CHUNK = 1 << 16
#: after a body at least this large is parsed and dropped, its source returns the
#: freed heap memory to the OS (kvledger.collect.memory)
LARGE_BODY = 4 << 20


def redact_url(url: str) -> str:
    """``url`` without its password (``user:***@host``); unparseable text is cut short."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url[:64] + ("..." if len(url) > 64 else "")
    if parts.password is None and "@" not in parts.netloc:
        return url
    host = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}" if user else host))


_USERINFO = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*://)([^/@\s:]*):[^/@\s]*@")


def redact_text(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ``***``."""
    return _USERINFO.sub(r"\1\2:***@", text)


# ---------------------------------------------------------------- the deadline watchdog


class _Watchdog:
    """One daemon thread that shuts down sockets whose exchange passed its deadline."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._armed: dict[int, socket.socket] = {}
        self._fired: set[int] = set()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, sock: socket.socket, deadline: float) -> int:
        with self._cond:
            token = next(self._ids)
            self._armed[token] = sock
            earliest = not self._heap or deadline < self._heap[0][0]
            heapq.heappush(self._heap, (deadline, token))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvledger-http-deadlines", daemon=True)
                self._thread.start()
            if earliest:  # otherwise the thread wakes for an earlier deadline first, and then sees this one
                self._cond.notify()
            return token

    def disarm(self, token: int) -> bool:
        """Forget ``token``; True if its deadline had already fired."""
        with self._cond:
            self._armed.pop(token, None)
            if token in self._fired:
                self._fired.discard(token)
                return True
            return False

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and self._heap[0][1] not in self._armed:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                deadline, token = self._heap[0]
                left = deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                heapq.heappop(self._heap)
                sock = self._armed.pop(token, None)
                if sock is not None:
                    self._fired.add(token)
                    _shutdown(sock)


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed or never connected


_WATCHDOG = _Watchdog()


# ---------------------------------------------------------------- connections


def _tls_files(tls: TlsClientConfig | None) -> tuple[tuple[str, float], ...]:
    """(path, mtime) of the TLS files: a change makes the next connection load them again."""
    out = []
    for path in (tls.ca_file, tls.cert_file, tls.key_file) if tls else ():
        if path:
            try:
                out.append((path, os.stat(path).st_mtime))
            except OSError:
                out.append((path, -1.0))
    return tuple(out)


class _HTTPSConnection(http.client.HTTPSConnection):
    """HTTPS whose certificate is checked against ``server_name`` (and SNI sends it) when given."""

    def __init__(self, host: str, port: int | None, timeout: float, context: ssl.SSLContext, server_name: str | None) -> None:
        super().__init__(host, port, timeout=timeout, context=context)
        self._server_name = server_name

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)
        assert self.sock is not None
        self.sock = self._context.wrap_socket(self.sock, server_hostname=self._server_name or self.host)  # type: ignore[attr-defined]  # HTTPSConnection's own context, as its connect() uses it


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


@dataclass(frozen=True)
class _Target:
    scheme: str
    host: str
    port: int | None
    path: str  # the request target, or the socket path for unix://
    authorization: str | None


def _target(url: str) -> _Target:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise SourceError("connect", f"{redact_url(url)}: bad URL: {exc}") from None
    if parts.scheme == "unix":
        if parts.netloc or not parts.path.startswith("/"):
            raise SourceError("connect", f"{redact_url(url)}: a Unix socket URL is unix:///absolute/path")
        return _Target("unix", "localhost", None, parts.path, None)
    if parts.scheme not in ("http", "https"):
        raise SourceError("connect", f"{redact_url(url)}: unsupported scheme {parts.scheme!r} (http, https or unix)")
    if not parts.hostname:
        raise SourceError("connect", f"{redact_url(url)}: no host in URL")
    auth = None
    if parts.username is not None:
        raw = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
        auth = "Basic " + base64.b64encode(raw).decode("ascii")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return _Target(parts.scheme, parts.hostname, port, target, auth)


@dataclass(frozen=True)
class Answer:
    """A 200 answer (``body``), or a 304 to a conditional GET (empty ``body``)."""

    status: int
    body: bytes
    etag: str | None  # the answer's ETag header, when it had one
    content_type: str | None
    date: str | None = None  # the answer's Date header: the server's clock when it answered


def default_max_lines(accept: str) -> int | None:
    """The line limit of a client that asks for ``accept``: ``MAX_TEXT_LINES`` for
    Prometheus text (``text/plain``), none for documents (JSON may be one long line)."""
    return MAX_TEXT_LINES if accept.strip().lower().startswith("text/plain") else None


class _Stale(Exception):
    """A kept-alive connection that the engine had closed: the request never got an answer."""


#: what a reused connection raises when the engine closed it as the request went out
_STALE_ERRORS = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError, http.client.RemoteDisconnected)


def _dropped(conn: http.client.HTTPConnection) -> bool:
    """Whether an idle connection was closed by the engine (its socket reads EOF, or
    anything at all: an idle HTTP/1.1 connection has nothing to say)."""
    sock = conn.sock
    if sock is None:
        return True
    try:
        if isinstance(sock, ssl.SSLSocket) and sock.pending():
            return True
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


_TCP_QUICKACK = getattr(socket, "TCP_QUICKACK", None)  # Linux


def _quick_ack(conn: http.client.HTTPConnection) -> None:
    """Acknowledge the answer's first segment at once. On a kept-alive connection an engine
    that writes its headers and its body separately without TCP_NODELAY (Python's
    http.server, among others) holds the body until the headers are acknowledged (Nagle),
    and the kernel would delay that acknowledgement by up to 40 ms (delayed ACK): set after
    the request is sent, the quick-ack mode covers the answer's first segments (Linux; a
    no-op elsewhere and on Unix sockets)."""
    sock = conn.sock
    if _TCP_QUICKACK is None or sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, _TCP_QUICKACK, 1)
    except OSError:
        pass


class HttpClient:
    """GETs one URL, bounded by ``timeout`` seconds in all, ``max_bytes`` of body and, for
    text, ``max_lines`` lines (by default ``default_max_lines(accept)``), presenting the
    engine's ``auth`` (authorization or basic_auth, tls_config) and keeping its connection
    alive between GETs."""

    def __init__(self, url: str, *, timeout: float, max_bytes: int = DEFAULT_MAX_BYTES, accept: str = "*/*",
                 max_lines: int | None = None, auth: ClientAuth | None = None) -> None:
        self.url = url
        self.where = redact_url(url)
        self.timeout = timeout
        self.max_bytes = max_bytes
        self.max_lines = max_lines if max_lines is not None else default_max_lines(accept)
        self.accept = accept
        self.auth = auth
        self._target = _target(url)  # a bad URL fails here, at configuration time
        self._lock = threading.Lock()
        self._conn: http.client.HTTPConnection | None = None  # the exchange in progress
        self._idle: http.client.HTTPConnection | None = None  # kept alive for the next GET
        self.connections = 0  # connections opened (a kept-alive one serves many GETs)
        tls = auth.tls_config if auth else None
        self._tls_stamp = _tls_files(tls)
        self._ssl: ssl.SSLContext | None = None
        if self._target.scheme == "https":
            try:
                self._ssl = client_ssl_context(tls)
            except ValueError as exc:
                raise SourceError("config", f"{self.where}: tls_config: {exc}") from None

    def _context(self) -> ssl.SSLContext:
        """The TLS context, loaded again when one of the tls_config files changed."""
        tls = self.auth.tls_config if self.auth else None
        stamp = _tls_files(tls)
        if self._ssl is None or stamp != self._tls_stamp:
            try:
                self._ssl = client_ssl_context(tls)
            except ValueError as exc:
                raise SourceError("config", f"{self.where}: tls_config: {exc}") from None
            self._tls_stamp = stamp
        return self._ssl

    def _tls_failure(self, exc: ssl.SSLError) -> str:
        """What a failed handshake says, with the check that failed when the engine's
        certificate was refused (``tls_failure``)."""
        tls = self.auth.tls_config if self.auth else None
        t = self._target
        return tls_failure(exc, tls.ca_file if tls else None, (tls.server_name if tls else None) or t.host)

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        t = self._target
        if t.scheme == "unix":
            return _UnixHTTPConnection(t.path, timeout)
        if t.scheme == "https":
            tls = self.auth.tls_config if self.auth else None
            return _HTTPSConnection(t.host, t.port, timeout, self._context(), tls.server_name if tls else None)
        return http.client.HTTPConnection(t.host, t.port, timeout=timeout)

    def abort(self) -> None:
        """End an exchange in progress now and close the kept-alive connection (used when
        the daemon stops or a source is replaced)."""
        with self._lock:
            conn, idle, self._idle = self._conn, self._idle, None
        if conn is not None and conn.sock is not None:
            _shutdown(conn.sock)
        if idle is not None:
            idle.close()

    close = abort

    def get(self) -> bytes:
        """The body of a 200 answer; SourceError(connect|timeout|http_status|too_large|parse|config)."""
        return self.fetch().body

    def fetch(self, *, accept: str | None = None, if_none_match: str | None = None) -> Answer:
        """A GET with ``accept`` in place of the client's Accept header and, when given,
        ``If-None-Match``: a 200 answer, or a 304 (no body) when ``if_none_match`` still
        names the document; SourceError as ``get``."""
        deadline = time.monotonic() + self.timeout
        accept = accept or self.accept
        headers = self._headers(accept, if_none_match)
        with self._lock:
            conn, self._idle = self._idle, None
        if conn is not None and _dropped(conn):
            conn.close()
            conn = None
        if conn is not None:
            try:
                return self._on(conn, deadline, accept, headers, reused=True)
            except _Stale:
                pass  # the engine closed it as the GET went out: once more on a new connection
        left = deadline - time.monotonic()
        if left <= 0:
            raise SourceError("timeout", self._late())
        conn = self._connection(left)
        try:
            conn.connect()
        except TimeoutError:
            conn.close()
            raise SourceError("timeout", f"{self.where}: connect timed out after {self.timeout:g}s") from None
        except ssl.SSLError as exc:
            conn.close()
            raise SourceError("connect", f"{self.where}: TLS handshake failed: {self._tls_failure(exc)}") from None
        except OSError as exc:
            conn.close()
            raise SourceError("connect", f"{self.where}: cannot connect: {exc.strerror or exc}") from None
        self.connections += 1
        return self._on(conn, deadline, accept, headers, reused=False)

    def _on(self, conn: http.client.HTTPConnection, deadline: float, accept: str, headers: dict[str, str], *,
            reused: bool) -> Answer:
        """One exchange on ``conn`` (connected) under the absolute ``deadline``; the
        connection is kept for the next GET when the answer allows it, else closed."""
        assert conn.sock is not None
        conn.sock.settimeout(max(0.001, deadline - time.monotonic()))  # a kept connection had an earlier poll's
        with self._lock:
            self._conn = conn
        keep = False
        try:
            token = _WATCHDOG.arm(conn.sock, deadline)
            error: tuple[str, str] | None = None
            answer = Answer(0, b"", None, None)
            try:
                answer, keep = self._exchange(conn, accept, headers, reused)
            except _Stale:
                if _WATCHDOG.disarm(token) or time.monotonic() >= deadline:
                    raise SourceError("timeout", self._late()) from None
                raise
            except SourceError as exc:
                error = (exc.reason, exc.message)
            except TimeoutError:
                error = ("timeout", self._late())
            except (http.client.HTTPException, ssl.SSLError, OSError, ValueError) as exc:
                error = _classify(exc, self.where)
            # The watchdog shuts the socket down at the deadline: whatever the read then
            # saw (an error, or an early end of the body), the answer came too late.
            if _WATCHDOG.disarm(token) or (error is not None and time.monotonic() >= deadline):
                error, keep = ("timeout", self._late()), False
            if error is not None:
                raise SourceError(*error)
            return answer
        finally:
            with self._lock:
                self._conn = None
                kept = keep and self._idle is None
                if kept:
                    self._idle = conn
            if not kept:
                conn.close()

    def get_text(self) -> str:
        """``get()`` decoded as UTF-8; SourceError(parse) names the first bad byte."""
        body = self.get()
        try:
            return body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SourceError("parse", f"{self.where}: body is not UTF-8 (byte {exc.start})") from None

    def _over_budget(self, poll: poll_budget.PollContext, what: str) -> str:
        budget = poll.budget
        return (f"{self.where}: {what} would pass the daemon's memory budget for engine answers "
                f"({budget.total:,} bytes for all engines together, limits.memory_budget_bytes; "
                f"{budget.in_use:,} in use by answers in flight): refused, asked again next cycle")

    def _late(self) -> str:
        return f"{self.where}: no complete answer within {self.timeout:g}s"

    def _authorization(self) -> str | None:
        """The Authorization header: the URL's userinfo, else the engine's authorization or
        basic_auth (files read now); SourceError(config) when a file cannot be used."""
        if self._target.authorization:
            return self._target.authorization
        auth = self.auth
        try:
            if auth is not None and (a := auth.authorization) is not None:
                credentials = (a.credentials.reveal() if a.credentials is not None
                               else read_secret_file(a.credentials_file or "", header=True))
                return f"{a.type} {credentials}"
            if auth is not None and (b := auth.basic_auth) is not None:
                if b.password is not None:
                    password = b.password.reveal()
                else:
                    password = read_secret_file(b.password_file) if b.password_file else ""
                return "Basic " + base64.b64encode(f"{b.username}:{password}".encode()).decode("ascii")
        except ValueError as exc:
            key = "authorization.credentials_file" if auth is not None and auth.authorization else "basic_auth.password_file"
            raise SourceError("config", f"{self.where}: {key}: {exc}") from None
        return None

    def _headers(self, accept: str, if_none_match: str | None) -> dict[str, str]:
        headers = {"Accept": accept, "Accept-Encoding": "identity", "User-Agent": "kvledger"}
        if (authorization := self._authorization()) is not None:
            headers["Authorization"] = authorization
        if if_none_match:
            headers["If-None-Match"] = if_none_match
        return headers

    def _exchange(self, conn: http.client.HTTPConnection, accept: str, headers: dict[str, str],
                  reused: bool) -> tuple[Answer, bool]:
        """The answer, and whether the connection may serve the next GET."""
        try:
            conn.request("GET", self._target.path, headers=headers)
            _quick_ack(conn)
            resp = conn.getresponse()
        except _STALE_ERRORS:
            if reused:
                raise _Stale from None
            raise
        keep = not resp.will_close
        if resp.status == 304 and "If-None-Match" in headers:
            resp.read()
            return Answer(304, b"", resp.getheader("ETag") or headers["If-None-Match"], None, resp.getheader("Date")), keep
        if resp.status != 200:
            raise SourceError("http_status", f"{self.where}: HTTP {resp.status}" + _status_note(resp.status))
        length = resp.getheader("Content-Length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_bytes:
            raise SourceError("too_large", f"{self.where}: body of {int(length)} bytes is over the limit of {self.max_bytes}")
        chunks: list[bytes] = []
        size = 0
        lines = 0
        max_lines = self.max_lines if accept == self.accept else default_max_lines(accept)
        poll = poll_budget.current()
        while True:
            chunk = resp.read1(_CHUNK)
            if not chunk:
                break
            size += len(chunk)
            if poll is not None and not poll.take(len(chunk)):
                chunks.clear()
                raise SourceError("too_large", self._over_budget(poll, f"its body ({size:,} bytes so far)"))
            if size > self.max_bytes:
                chunks.clear()
                release_freed_memory()
                raise SourceError("too_large", f"{self.where}: body over the limit of {self.max_bytes} bytes")
            if max_lines is not None:
                lines += chunk.count(b"\n")
                if lines > max_lines:
                    chunks.clear()
                    release_freed_memory()
                    raise SourceError("too_large", f"{self.where}: body over the limit of {max_lines} lines "
                                                   "(refused while it streamed in, before parsing)")
            chunks.append(chunk)
        if length is not None and length.strip().isdigit() and size != int(length):
            raise SourceError("parse", f"{self.where}: body truncated after {size} of {int(length)} bytes")
        if poll is not None:
            if not poll.take(size * (poll_budget.PARSE_FACTOR - 1)):
                chunks.clear()
                raise SourceError("too_large", self._over_budget(poll, f"parsing its body of {size:,} bytes"))
            poll.answered(size, lines if max_lines is not None else None)
        answer = Answer(200, b"".join(chunks), resp.getheader("ETag"), resp.getheader("Content-Type"), resp.getheader("Date"))
        if not resp.isclosed() and resp.read(1):  # ends the answer (read1 leaves it open at length 0)
            return answer, False  # more than the answer said: the connection is not clean
        return answer, keep and resp.isclosed()  # the whole answer read: the connection is free for the next GET


#: OpenSSL's verify codes (X509_V_ERR_*) of the checks an engine's certificate fails most
_VERIFY_CHECKS = {
    9: "the engine's certificate is not valid yet (notBefore is in the future: check the clocks)",
    10: "the engine's certificate has expired",
    18: "the engine's certificate is self-signed and not trusted",
    19: "the engine's certificate chain ends in a self-signed CA that is not trusted",
    20: "the engine's certificate was issued by a CA that is not trusted",
    21: "the engine's certificate was issued by a CA that is not trusted",
    23: "the engine's certificate was revoked",
    26: "the engine's certificate is not meant for a server (its purpose)",
}
_HOSTNAME_MISMATCH = 62


def tls_failure(exc: ssl.SSLError, ca_file: str | None, server_name: str) -> str:
    """A failed handshake's reason, naming the check when the certificate was refused:
    expired, self-signed, issued by an untrusted CA (saying whether ``ca_file`` was set),
    or naming another host than ``server_name``; OpenSSL's own verify message follows."""
    reason = exc.reason or str(exc)
    if not isinstance(exc, ssl.SSLCertVerificationError):
        return str(reason)
    code = exc.verify_code
    detail = exc.verify_message or ""
    if code == _HOSTNAME_MISMATCH:
        check = (f"the engine's certificate does not name {server_name!r} (hostname mismatch; "
                 "tls_config.server_name sets the name to check)")
    else:
        check = _VERIFY_CHECKS.get(code, "the engine's certificate was refused")
    if code in (18, 19, 20, 21):
        check += (f" by tls_config.ca_file {ca_file}" if ca_file
                  else " by the system's CAs (no tls_config.ca_file is set: set it to the CA that signed it)")
    return f"{reason}: {check} (OpenSSL: {detail}, code {code})"


def _status_note(status: int) -> str:
    if 300 <= status < 400:
        return " (redirects are not followed: configure the final URL)"
    if status in (401, 403):
        return " (the engine refused the request's credentials: check authorization, basic_auth or tls_config)"
    return ""


def _classify(exc: BaseException, where: str) -> tuple[str, str]:
    if isinstance(exc, http.client.IncompleteRead):
        return "parse", f"{where}: body truncated after {len(exc.partial)} bytes"
    if isinstance(exc, http.client.RemoteDisconnected):
        return "connect", f"{where}: the engine closed the connection without an answer"
    if isinstance(exc, (http.client.LineTooLong, http.client.HTTPException)):
        return "parse", f"{where}: not an HTTP answer ({type(exc).__name__})"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return "connect", f"{where}: TLS error: {tls_failure(exc, None, '?')}"
    if isinstance(exc, ssl.SSLError):
        return "connect", f"{where}: TLS error: {exc.reason or type(exc).__name__}"
    if isinstance(exc, OSError):
        return "connect", f"{where}: connection failed: {exc.strerror or type(exc).__name__}"
    return "parse", f"{where}: bad answer ({type(exc).__name__})"
