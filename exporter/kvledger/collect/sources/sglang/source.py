"""The ``kind: sglang`` source: GET ``cfg.url`` (SGLang's /metrics) and map it with
``sglang_facts``.

SGLang's server information (``/server_info``; ``/get_server_info`` on older builds) states two
settings /metrics does not always carry:

- ``page_size``: used when /metrics does not export ``sglang:page_size`` (builds before the kv_*
  token gauges). With ``server_info_url`` configured it is read once; a failure to read it
  fails the poll with the reason (the block size would be wrong otherwise).
- ``decode_log_interval``: SGLang refreshes its KV and request gauges at prefill batches and
  every ``--decode-log-interval`` decode steps (default 40), so what /metrics shows can lag the
  pool by that many steps. It is exported as ``kvledger_source_refresh_interval_steps``. The
  configuration's ``decode_log_interval`` states it; else it is read from ``server_info_url``
  or, when that is not configured, from ``/server_info`` beside ``url``. That read never fails
  the poll (the series is absent while it is unknown); it is made at the first poll, after any
  failed poll (the engine may have restarted with other flags) and, after a failed read, again
  at most every ``INFO_RETRY_SECONDS``. /server_info passes through SGLang's scheduler, so it is
  never read at every poll.

With ``ledger:`` (the kvledger SGLang plugin's address, ``KVLEDGER_SGLANG_LEDGER``;
``{dp_rank}`` per data-parallel rank) the plugin's kvledger/v1 documents give the pools and
the requests exactly (``merge_scheduler_facts``): every admitted request's prompt, cap, output
so far and pages held, so the reservation is exact; the pages in use, evictable (the radix
cache's unlocked pages: reclaimable) and free as the scheduler holds them at its last
publication (no decode-log lag); retractions and the tokens they threw away; SGLang's own
admission estimate. /metrics is read beside it, each part on half the engine's timeout, and
keeps what only it says (the prefix-cache counters, SGLang's own usage claim). All ranks or
none: when a rank's document is missing or malformed the poll keeps the /metrics figures and
the ``ledger`` sub-source says why.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kvledger.collect.sources.base import EngineContribution, Source, SourceError, SubsourceReport
from kvledger.collect.sources.document import FactsReader
from kvledger.collect.sources.http_client import HttpClient
from kvledger.collect.sources.prom_text import parse_exposition
from kvledger.collect.sources.sglang.metrics import PAGE_SIZE, sglang_facts
from kvledger.config.types import EngineConfig
from kvledger.domain.facts import Budgets, EngineFacts
from kvledger.domain.limits import MAX_TOKENS
from kvledger.domain.request_table import RequestTable

DP_PLACEHOLDER = "{dp_rank}"

#: seconds between two attempts to read the decode-log interval after one failed
INFO_RETRY_SECONDS = 60.0


def _info_doc(body: str, where: str) -> dict[str, Any]:
    try:
        doc: Any = json.loads(body)
    except (ValueError, RecursionError):
        raise SourceError("parse", f"{where}: not a JSON document") from None
    if not isinstance(doc, dict):
        raise SourceError("schema", f"{where}: expected a JSON object, got {type(doc).__name__}")
    return doc


def _whole(doc: dict[str, Any], key: str, where: str) -> int | None:
    value = doc.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOKENS:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise SourceError("schema", f"{where}: {key} must be an integer in [1, {MAX_TOKENS}], got {shown}")
    return value


def page_size_from_server_info(body: str, where: str) -> int:
    """``page_size`` of SGLang's /server_info JSON (the server arguments); 1 when absent."""
    return _whole(_info_doc(body, where), "page_size", where) or 1


def decode_log_interval_from_server_info(body: str, where: str) -> int | None:
    """``decode_log_interval`` of SGLang's /server_info JSON; None when the build does not state it."""
    return _whole(_info_doc(body, where), "decode_log_interval", where)


def server_info_beside(metrics_url: str) -> str | None:
    """``/server_info`` on the origin of an http(s) /metrics address (None for other schemes)."""
    parts = urlsplit(metrics_url)
    if parts.scheme not in ("http", "https"):
        return None
    return urlunsplit((parts.scheme, parts.netloc, "/server_info", "", ""))


def merge_scheduler_facts(metrics: EngineFacts | None, rank_facts: dict[str, EngineFacts], name: str) -> EngineFacts:
    """``metrics`` (None when /metrics gave nothing) with every pool, request and budget
    taken from ``rank_facts`` (by data-parallel rank = pool id) and the retractions they
    counted; SourceError ``schema`` when a document is not one pool of its rank's id."""
    base = metrics if metrics is not None else EngineFacts(name=name, kind="sglang", source="sglang")
    seen = {p.id: p for p in base.pools}
    pools = []
    for rank, doc in rank_facts.items():
        if len(doc.pools) != 1 or doc.pools[0].id != rank:
            names = ", ".join(repr(p.id) for p in doc.pools) or "none"
            raise SourceError("schema", f"ledger of rank {rank}: expected one pool with id {rank!r}, found {names}")
        exact = doc.pools[0]
        claim = seen.get(rank)
        if claim is not None and (claim.num_blocks, claim.block_size) != (exact.num_blocks, exact.block_size):
            claim = None  # /metrics describes another pool than this document's
        pools.append(dataclasses.replace(
            exact, engine_reported_used_blocks=None if claim is None else claim.engine_reported_used_blocks))
    counters = dict(base.counters)
    retracted = [d.counters.get("preemptions") for d in rank_facts.values()]
    if None not in retracted:
        counters["preemptions"] = sum(v for v in retracted if v is not None)
    budgets = [d.budgets for d in rank_facts.values()]
    lens = [b.max_model_len for b in budgets if b.max_model_len is not None]

    def total(field: str) -> int | None:
        values = [getattr(b, field) for b in budgets]
        return None if None in values else sum(values)

    return dataclasses.replace(
        base,
        version=next(iter(rank_facts.values())).version or base.version,
        published_at=min((d.published_at for d in rank_facts.values() if d.published_at is not None), default=None),
        pools=pools,
        requests=RequestTable.concat([RequestTable.from_requests(d.requests or []) for d in rank_facts.values()]),
        request_counts=None,
        counters=counters,
        budgets=Budgets(max_num_batched_tokens=total("max_num_batched_tokens"), iteration_tokens=total("iteration_tokens"),
                        max_num_seqs=total("max_num_seqs"), max_model_len=min(lens) if lens else base.budgets.max_model_len),
    )


class SglangSource(Source):
    kind = "sglang"

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg, self.engine = cfg, cfg.name
        self._http = HttpClient(cfg.url, timeout=cfg.timeout_seconds, max_bytes=cfg.max_response_bytes, max_lines=cfg.max_response_lines,
                                accept="text/plain;version=0.0.4", auth=cfg.client_auth)
        configured = cfg.option("server_info_url")
        info = configured or server_info_beside(cfg.url)
        self._info_configured = configured is not None
        self._info = HttpClient(info, timeout=cfg.timeout_seconds, max_bytes=cfg.max_response_bytes, max_lines=cfg.max_response_lines,
                                accept="application/json", auth=cfg.client_auth) if info else None
        self._page_size: int | None = None
        stated = cfg.option("decode_log_interval")
        self._interval_stated = int(stated) if stated is not None else None
        self._interval: int | None = self._interval_stated
        self._interval_due = 0.0  # monotonic time of the next read of the interval (0: at the next poll)
        self._ledger_address = cfg.option("ledger")
        self._part = cfg.timeout_seconds / 2 if self._ledger_address else cfg.timeout_seconds
        self._http.timeout = self._part
        self._ledgers: dict[str, FactsReader] = {}
        self._ledger_error: str | None = "not read yet" if self._ledger_address else None
        self._metrics_error: str | None = "not read yet" if self._ledger_address else None
        self._ranks: tuple[str, ...] = ("0",)

    def _metrics(self) -> EngineFacts:
        try:
            deadline = time.monotonic() + self._part  # the poll's share of the timeout, for the parse too
            exp = parse_exposition(self._http.get_text(), deadline)
            page_size = None
            if PAGE_SIZE not in exp and self._info is not None and self._info_configured:
                if self._page_size is None:
                    self._page_size = page_size_from_server_info(self._info.get_text(), self._info.where)
                page_size = self._page_size
            facts = sglang_facts(exp, self.cfg, page_size)
        except BaseException:
            # the engine may come back restarted, with other settings: read them again then
            self._page_size = None
            self._interval_due = 0.0
            raise
        self._refresh_interval()
        return facts

    def poll(self) -> EngineContribution:
        if not self._ledger_address:
            return EngineContribution(self._metrics())
        metrics: EngineFacts | None = None
        failure: SourceError | None = None
        try:
            metrics = self._metrics()
            self._metrics_error = None
            # the data-parallel ranks: the full pools /metrics names
            ranks = tuple(sorted((p.id for p in metrics.pools if p.id.isdigit()), key=int))
            if ranks:
                self._ranks = ranks
        except SourceError as exc:
            failure, self._metrics_error = exc, f"{exc.reason}: {exc.message}"
        try:
            facts = merge_scheduler_facts(metrics, self._read_rank_facts(), self.cfg.name)
        except SourceError as exc:
            self._ledger_error = f"{exc.reason}: {exc.message}"
            if metrics is None:
                assert failure is not None
                raise failure from None
            return EngineContribution(metrics)
        self._ledger_error = None
        return EngineContribution(facts)

    def _read_rank_facts(self) -> dict[str, EngineFacts]:
        address = self._ledger_address
        assert address
        ranks = self._ranks if DP_PLACEHOLDER in address else ("0",)
        if len(self._ranks) > 1 and DP_PLACEHOLDER not in address:
            raise SourceError("config", f"ledger: {address} has no {DP_PLACEHOLDER}, but /metrics shows "
                                        f"{len(self._ranks)} data-parallel ranks (each serves its own ledger)")
        out = {}
        for rank in ranks:
            reader = self._ledgers.get(rank)
            if reader is None:
                client = HttpClient(address.replace(DP_PLACEHOLDER, rank), timeout=self._part,
                                    max_bytes=self.cfg.max_response_bytes, accept="application/json",
                                    auth=self.cfg.client_auth)
                reader = self._ledgers[rank] = FactsReader(client, self.cfg.name)
            facts = reader.read()
            if DP_PLACEHOLDER not in address and len(facts.pools) == 1:
                rank = facts.pools[0].id  # the one pool the address serves, whatever its rank
            out[rank] = facts
        return out

    def subsource_health(self) -> list[SubsourceReport]:
        """``ledger`` and ``metrics`` (/metrics beside the ledger), with a ledger configured."""
        if not self._ledger_address:
            return []
        ages = [r.age for r in self._ledgers.values() if r.age is not None]
        return [SubsourceReport("ledger", self._ledger_error is None, self._ledger_error, max(ages) if ages else None),
                SubsourceReport("metrics", self._metrics_error is None, self._metrics_error)]

    def _refresh_interval(self) -> None:
        if self._interval_stated is not None or self._info is None or time.monotonic() < self._interval_due:
            return
        try:
            self._interval = decode_log_interval_from_server_info(self._info.get_text(), self._info.where)
            self._interval_due = float("inf")  # until a poll fails
        except SourceError:
            self._interval = None
            self._interval_due = time.monotonic() + INFO_RETRY_SECONDS

    def refresh_interval_steps(self) -> int | None:
        return self._interval

    def close(self) -> None:
        self._http.abort()
        if self._info is not None:
            self._info.abort()
        for reader in self._ledgers.values():
            reader.client.abort()
