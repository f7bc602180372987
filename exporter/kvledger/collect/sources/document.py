"""The ``ledger`` source: a kvledger/v1 document over HTTP(S) or HTTP over a Unix socket.

``url`` is ``http://host:port/path``, ``https://...`` or ``unix:///path/to/socket``
(then ``GET /`` is sent over the socket, with HTTP/1.1). ``timeout_seconds`` bounds
the whole exchange (connect, headers and body together). The document is exact; what
only the configuration knows is merged in by the collector (``facts_merge``).

Each GET asks for the cheaper forms a server may offer (docs/ledger.md, "Cheaper reads"):
the columnar form (``Accept``), and, once the server has sent an ``ETag``, a conditional
read (``If-None-Match``) that an unchanged ledger answers 304 without a body. A plain v1
server ignores both and serves its row form as before.

Errors (SourceError reasons): ``connect``, ``timeout``, ``http_status``, ``too_large``
(the HTTP client's, see ``http_client``), ``parse`` (not JSON), ``schema`` (breaks
kvledger/v1; the message names the field path), ``stale`` (the document shows running
requests but its ``published_at`` is older than ``MAX_DOCUMENT_AGE``: the writer stopped
publishing while its server answers; its numbers are not given as exact).
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

from kvledger.collect.memory import release_freed_memory
from kvledger.collect.sources.base import EngineContribution, Source, SourceError
from kvledger.collect.sources.http_client import LARGE_BODY, Answer, HttpClient
from kvledger.config.types import EngineConfig
from kvledger.domain.facts import EngineFacts
from kvledger.domain.limits import MAX_DOCUMENT_AGE
from kvledger.domain.request_table import RequestTable
from kvledger.protocol.reader import COLUMNS_MEDIA_TYPE, NotJsonError, ProtocolError, SectionMemo, facts_from_json

#: what a ledger GET accepts: the columnar form first, the row form (plain v1) as well
ACCEPT = f"{COLUMNS_MEDIA_TYPE}, application/json;q=0.9"


def parse_document(body: bytes, where: str, engine: str, memo: SectionMemo | None = None) -> EngineFacts:
    """The facts of a kvledger/v1 document body; SourceError ``parse`` or ``schema`` naming
    ``where``. ``memo``: the engine's sections as last read (``protocol.reader.SectionMemo``)."""
    try:
        return facts_from_json(body, engine, memo=memo)
    except NotJsonError as exc:  # also invalid UTF-8
        raise SourceError("parse", f"{where}: document is not JSON (line {exc.line}, column {exc.column}: {exc.reason})") from None
    except ProtocolError as exc:
        raise SourceError("schema", f"{where}: not a kvledger/v1 document: {exc}") from None


#: one document is decoded and converted at a time: the engines' polls run at once, and
#: interleaving their parsing only adds interpreter hand-offs and holds every decoded
#: document in memory together (the fetches, which wait on the network, still overlap)
PARSE_LOCK = threading.Lock()


@dataclass
class _Read:
    key: bytes | None  # the body, or its digest when large; None when the server tags it
    etag: str | None
    facts: EngineFacts
    running: bool  # whether the document shows a running request


def shows_running(facts: EngineFacts) -> bool:
    """Whether the document shows a running request (work that moves at every engine step)."""
    requests = facts.requests
    if requests is None:
        return False
    if isinstance(requests, RequestTable):
        return "running" in requests.states
    return any(r.state == "running" for r in requests)


def document_age(published_at: float, date: str | None, now: float) -> float:
    """Seconds since ``published_at`` (the writer's clock) by the server's ``Date`` header,
    so that the two clocks are one (a remote engine's offset cancels; the header's whole
    seconds make the age at most 1 s short); by the reader's clock when there is none."""
    reference = now
    if date:
        try:
            reference = _date_seconds(date)
        except (TypeError, ValueError, OverflowError, IndexError):
            reference = now
    return max(0.0, reference - published_at)


#: the last Date header read and its time: the engines answering within one second send the
#: same header, parsed once (``parsedate_to_datetime`` costs about as much as a 304 exchange's
#: own work); one tuple, replaced whole, so any poll thread reads a consistent pair
_LAST_DATE: tuple[str, float] = ("", 0.0)


def _date_seconds(date: str) -> float:
    """The time a Date header names (Unix seconds); raises as ``parsedate_to_datetime`` does."""
    global _LAST_DATE
    last = _LAST_DATE
    if last[0] == date:
        return last[1]
    seconds = parsedate_to_datetime(date).timestamp()
    _LAST_DATE = (date, seconds)
    return seconds


class FactsReader:
    """One kvledger/v1 address read as cheaply as its server allows: a 304 or an unchanged
    body gives the facts of the previous read without parsing (``read`` returns the same
    object, so callers can tell nothing changed)."""

    def __init__(self, client: HttpClient, engine: str) -> None:
        self.client = client
        self.engine = engine
        self._last: _Read | None = None
        self.not_modified = 0  # reads answered 304
        self.unchanged = 0  # 200 answers with the previous body
        self.columnar = 0  # documents read in the columnar form
        self.age: float | None = None  # the latest document's age (its published_at; None without one)
        self.max_age = MAX_DOCUMENT_AGE
        self.sections = SectionMemo()  # the sections of the last document that rarely change, as read

    def read(self) -> EngineFacts:
        """The facts of the document now; SourceError ``stale`` when it shows running requests
        but was published more than ``max_age`` seconds ago (the writer stopped publishing:
        its numbers are old, so they are not given as exact)."""
        last = self._last
        answer = self.client.fetch(accept=ACCEPT, if_none_match=None if last is None else last.etag)
        read = self._read(answer, last)
        published_at = read.facts.published_at
        self.age = None if published_at is None else document_age(published_at, answer.date, time.time())
        if self.age is not None and self.age > self.max_age and read.running:
            raise SourceError(
                "stale",
                f"{self.client.where}: the document was published {self.age:.0f} s ago while it shows running "
                f"requests (more than {self.max_age:g} s): the engine has stopped publishing, its figures are old",
            )
        return read.facts

    def _read(self, answer: Answer, last: _Read | None) -> _Read:
        if answer.status == 304 and last is not None:
            self.not_modified += 1
            return last
        body = answer.body
        # without an ETag, an idle engine is recognised by its body (a large one by its
        # digest, so the daemon does not hold a copy between polls)
        key = None if answer.etag else body if len(body) < LARGE_BODY else hashlib.blake2b(body, digest_size=32).digest()
        if last is not None and key is not None and key == last.key:
            self.unchanged += 1
            return last
        self._last = None
        try:
            with PARSE_LOCK:
                facts = parse_document(body, self.client.where, self.engine, self.sections)
        finally:
            if len(body) >= LARGE_BODY:
                del body
                release_freed_memory()
        if answer.content_type is not None and answer.content_type.startswith(COLUMNS_MEDIA_TYPE):
            self.columnar += 1
        self._last = _Read(key, answer.etag, facts, shows_running(facts))
        return self._last


class LedgerSource(Source):
    kind = "ledger"

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.engine = cfg.name
        self._http = HttpClient(
            cfg.url, timeout=cfg.timeout_seconds, max_bytes=cfg.max_response_bytes, accept="application/json",
            auth=cfg.client_auth,
        )
        self.reader = FactsReader(self._http, cfg.name)
        self._last: tuple[EngineFacts, EngineContribution] | None = None
        self.url = self._http.where  # without credentials: safe in messages

    def poll(self) -> EngineContribution:
        facts = self.reader.read()
        if self._last is not None and self._last[0] is facts:  # unchanged: the same contribution
            return self._last[1]
        contribution = EngineContribution(facts)
        self._last = (facts, contribution)
        return contribution

    def document_age(self) -> float | None:
        return self.reader.age

    def close(self) -> None:
        self._http.abort()
