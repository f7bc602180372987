"""The ``ledger`` source: a kvledger/v1 document over HTTP(S) or HTTP over a Unix socket.

``url`` is ``http://host:port/path``, ``https://...`` or ``unix:///path/to/socket``
(then ``GET /`` is sent over the socket, with HTTP/1.1). ``timeout_seconds`` bounds
the whole exchange (connect, headers and body together). The document is exact; what
only the configuration knows is merged in by the collector (``facts_merge``).

Errors (SourceError reasons): ``connect``, ``timeout``, ``http_status``, ``too_large``
(the HTTP client's, see ``http_client``), ``parse`` (not JSON), ``schema`` (breaks
kvledger/v1; the message names the field path).
"""

from __future__ import annotations

import hashlib

import orjson

from kvledger.config import EngineConfig
from kvledger.facts import EngineFacts
from kvledger.memory import release_freed_memory
from kvledger.protocol import ProtocolError, facts_from_document
from kvledger.sources.base import EngineContribution, Source, SourceError
from kvledger.sources.http_client import LARGE_BODY, HttpClient


def parse_document(body: bytes, where: str, engine: str) -> EngineFacts:
    """The facts of a kvledger/v1 document body; SourceError ``parse`` or ``schema`` naming ``where``."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:  # also invalid UTF-8
        raise SourceError("parse", f"{where}: document is not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    try:
        return facts_from_document(doc, engine)
    except ProtocolError as exc:
        raise SourceError("schema", f"{where}: not a kvledger/v1 document: {exc}") from None


class LedgerSource(Source):
    kind = "ledger"

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self._last: tuple[bytes, EngineContribution] | None = None  # (body or its digest, facts)
        self.engine = cfg.name
        self._http = HttpClient(
            cfg.url, timeout=cfg.timeout_seconds, max_bytes=cfg.max_response_bytes, accept="application/json"
        )
        self.url = self._http.where  # without credentials: safe in messages

    def poll(self) -> EngineContribution:
        body = self._http.get()
        # an idle engine serves the same document: its facts are the same. A large body
        # is remembered by its digest, so the daemon does not hold a copy between polls.
        key = body if len(body) < LARGE_BODY else hashlib.blake2b(body, digest_size=32).digest()
        if self._last is not None and key == self._last[0]:
            return self._last[1]
        self._last = None
        try:
            contribution = self._parse(body)
        finally:
            if len(body) >= LARGE_BODY:
                del body
                release_freed_memory()
        self._last = (key, contribution)
        return contribution

    def _parse(self, body: bytes) -> EngineContribution:
        return EngineContribution(parse_document(body, self.url, self.cfg.name))

    def close(self) -> None:
        self._http.abort()
