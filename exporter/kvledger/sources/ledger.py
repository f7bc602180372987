"""The ``ledger`` source: a kvledger/v1 document over HTTP(S) or HTTP over a Unix socket.

``url`` is ``http://host:port/path``, ``https://...`` or ``unix:///path/to/socket``
(then ``GET /`` is sent over the socket, with HTTP/1.1). ``timeout_seconds`` bounds
the whole exchange (connect and every read together). The document is exact; the
source adds what only the configuration knows (budgets the document lacks, admission
and overflow overrides, tenant quotas, GPUs, PIDs, memory terms, host limits).

Errors (SourceError reasons): ``connect``, ``timeout``, ``http_status``, ``too_large``
(the HTTP client's, see ``http_client``), ``parse`` (not JSON), ``schema`` (breaks
kvledger/v1; the message names the field path).
"""

from __future__ import annotations

import dataclasses
import hashlib

import orjson

from kvledger.config import EngineConfig
from kvledger.model import Budgets, EngineFacts, HostFacts, Limit, MemoryTerm, TenantQuota
from kvledger.protocol import ProtocolError, facts_from_document
from kvledger.memory import release_freed_memory
from kvledger.sources.base import EngineContribution, Source, SourceError
from kvledger.sources.http_client import LARGE_BODY, HttpClient

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
        del doc
        return EngineContribution(apply_config(facts, self.cfg))

    def close(self) -> None:
        self._http.abort()
