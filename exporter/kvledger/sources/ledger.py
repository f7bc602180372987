"""The ``ledger`` source: a kvledger/v1 document over HTTP(S) or HTTP over a Unix socket.

``url`` is ``http://host:port/path``, ``https://...`` or ``unix:///path/to/socket``
(then ``GET /`` is sent over the socket, with HTTP/1.1). ``timeout_seconds`` bounds
the whole exchange (connect and every read together). The document is exact; the
source adds what only the configuration knows (budgets the document lacks, admission
and overflow overrides, tenant quotas, GPUs, PIDs, memory terms, host limits).

Errors (SourceError reasons): ``connect``, ``timeout``, ``http_status``, ``parse``
(not JSON), ``schema`` (breaks kvledger/v1; the message names the field path).
"""

from __future__ import annotations

import dataclasses
import http.client
import orjson
import socket
import ssl
import time
from urllib.parse import urlsplit

from kvledger.config import EngineConfig
from kvledger.model import Budgets, EngineFacts, HostFacts, Limit, MemoryTerm, TenantQuota
from kvledger.protocol import ProtocolError, facts_from_document
from kvledger.sources.base import EngineContribution, Source, SourceError

MAX_DOCUMENT_BYTES = 512 * 2**20


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


def fetch(url: str, timeout: float) -> bytes:
    """GET ``url`` within ``timeout`` seconds in total; raises SourceError."""
    parts = urlsplit(url)
    deadline = time.monotonic() + timeout
    if parts.scheme == "unix":
        path = parts.path or parts.netloc
        conn: http.client.HTTPConnection = _UnixHTTPConnection(path, timeout)
        target, where = "/", path
    elif parts.scheme in ("http", "https"):
        if not parts.hostname:
            raise SourceError("connect", f"{url}: no host in URL")
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        kwargs = {"context": ssl.create_default_context()} if parts.scheme == "https" else {}
        conn = cls(parts.hostname, parts.port, timeout=timeout, **kwargs)  # type: ignore[arg-type]
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        where = url
    else:
        raise SourceError("connect", f"{url}: unsupported scheme {parts.scheme!r} (http, https or unix)")
    try:
        try:
            conn.connect()
        except (TimeoutError, socket.timeout):
            raise SourceError("timeout", f"{where}: connect timed out after {timeout:g}s") from None
        except OSError as exc:
            raise SourceError("connect", f"{where}: cannot connect: {exc.strerror or exc}") from None
        try:
            conn.request("GET", target, headers={"Accept": "application/json"})
            _remaining(conn, deadline, timeout, where)
            resp = conn.getresponse()
            if resp.status != 200:
                raise SourceError("http_status", f"{where}: HTTP {resp.status} {resp.reason}")
            chunks, size = [], 0
            while True:
                _remaining(conn, deadline, timeout, where)
                chunk = resp.read1(1 << 20)
                if not chunk:
                    break
                size += len(chunk)
                if size > MAX_DOCUMENT_BYTES:
                    raise SourceError("parse", f"{where}: document larger than {MAX_DOCUMENT_BYTES} bytes")
                chunks.append(chunk)
            return b"".join(chunks)
        except (TimeoutError, socket.timeout):
            raise SourceError("timeout", f"{where}: no complete answer within {timeout:g}s") from None
        except (http.client.HTTPException, ssl.SSLError) as exc:
            raise SourceError("parse", f"{where}: bad HTTP answer: {exc!r}") from None
        except OSError as exc:
            raise SourceError("connect", f"{where}: connection failed: {exc.strerror or exc}") from None
    finally:
        conn.close()


def _remaining(conn: http.client.HTTPConnection, deadline: float, timeout: float, where: str) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise SourceError("timeout", f"{where}: no complete answer within {timeout:g}s")
    if conn.sock is not None:
        conn.sock.settimeout(left)


def apply_config(facts: EngineFacts, cfg: EngineConfig) -> EngineFacts:
    """Add what only the configuration knows to a document's facts (a new object)."""
    b = facts.budgets
    budgets = Budgets(
        max_num_batched_tokens=b.max_num_batched_tokens if b.max_num_batched_tokens is not None else cfg.max_num_batched_tokens,
        iteration_tokens=b.iteration_tokens,
        max_num_seqs=b.max_num_seqs if b.max_num_seqs is not None else cfg.max_num_seqs,
        max_model_len=b.max_model_len if b.max_model_len is not None else cfg.max_model_len,
    )
    tenants = [TenantQuota(t.name, t.quota_bytes) for t in cfg.tenants] if cfg.tenants else list(facts.tenants)
    gpus = list(cfg.gpus) if cfg.gpus else sorted({t.gpu for t in facts.memory})
    memory = list(facts.memory)
    given = {(t.gpu, t.category) for t in memory}
    for category, term in cfg.memory.terms.items():
        for gpu in gpus:
            if (gpu, category) not in given:
                memory.append(MemoryTerm(gpu, category, term.value, term.source))  # type: ignore[arg-type]
    h = facts.host
    host = dataclasses.replace(h)
    hc = cfg.host
    if host.output_buffer_limit is None and hc.output_buffer_limit_bytes is not None:
        host.output_buffer_limit = Limit(hc.output_buffer_limit_bytes.value, hc.output_buffer_limit_bytes.kind)  # type: ignore[arg-type]
    if host.network_queue_limit is None and hc.network_queue_limit is not None:
        host.network_queue_limit = Limit(hc.network_queue_limit.value, hc.network_queue_limit.kind)  # type: ignore[arg-type]
    return dataclasses.replace(
        facts,
        name=cfg.name,
        source="ledger",
        admission=cfg.admission or facts.admission,  # type: ignore[arg-type]
        overflow=cfg.overflow or facts.overflow,  # type: ignore[arg-type]
        budgets=budgets,
        tenants=tenants,
        gpus=gpus,
        pids=list(cfg.processes.pids) if cfg.processes is not None else list(facts.pids),
        memory=memory,
        host=host if isinstance(host, HostFacts) else HostFacts(),
    )


class LedgerSource(Source):
    kind = "ledger"

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self._last: tuple[bytes, EngineContribution] | None = None
        self.engine = cfg.name
        self.url = cfg.url

    def poll(self) -> EngineContribution:
        body = fetch(self.url, self.cfg.timeout_seconds)
        if self._last is not None and body == self._last[0]:
            # an idle engine serves the same document: its facts are the same
            return self._last[1]
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError as exc:  # also invalid UTF-8
            raise SourceError(
                "parse", f"{self.url}: document is not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
            ) from None
        try:
            facts = facts_from_document(doc, self.cfg.name)
        except ProtocolError as exc:
            raise SourceError("schema", f"{self.url}: not a kvledger/v1 document: {exc}") from None
        contribution = EngineContribution(apply_config(facts, self.cfg))
        self._last = (body, contribution)
        return contribution
