"""The ``kind: vllm`` source: /metrics, plus optional KV events (ZMQ) and startup log.

``poll()`` GETs ``cfg.url`` (bounded by ``cfg.timeout_seconds`` as a total deadline),
maps it with ``vllm_facts_from_metrics`` and merges the secondary sub-sources:
- KV events: ``pool.cached_blocks`` per DP rank (None while the count cannot be trusted),
  ``kv_events`` by type and ``kv_events_lost``;
- startup log: measured memory terms per GPU;
- the in-engine ledger (``ledger:``, sources/vllm/ledger.py): exact pools and requests in
  place of the /metrics bounds, all ranks or none.
A change of ``process_start_time_seconds`` (the API server's own series) between two
polls means the engine restarted: the KV-event count of the old run is dropped then, even
before the new run publishes anything (an idle restarted engine publishes nothing).
Trouble in a sub-source never fails the poll; ``subsource_health()`` reports it.
"""

from __future__ import annotations

import dataclasses
import math
import re

from kvledger.collect.sources.base import EngineContribution, Source, SourceError, SubsourceReport
from kvledger.collect.sources.http_client import HttpClient
from kvledger.collect.sources.model_config import ModelConfig
from kvledger.collect.sources.vllm.engine_documents import LedgerReader, merge_ledger
from kvledger.collect.sources.vllm.events_subscriber import KvEventSubscriber
from kvledger.collect.sources.vllm.metrics import vllm_facts_from_metrics
from kvledger.collect.sources.vllm.startup_log import VllmLogReader, memory_terms
from kvledger.config.model import EngineConfig
from kvledger.model.facts import EngineFacts

_START_TIME = re.compile(r"^process_start_time_seconds(?:\{\})? (\S+)(?: -?[0-9]+)?$", re.MULTILINE)


def process_start_time(text: str) -> float | None:
    """The one unlabelled ``process_start_time_seconds`` sample; None if absent, repeated or bad."""
    found = _START_TIME.findall(text)
    if len(found) != 1:
        return None
    try:
        value = float(found[0])
    except ValueError:
        return None
    return value if math.isfinite(value) else None


class VllmSource(Source):
    kind = "vllm"

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.engine = cfg.name
        self._http = HttpClient(
            cfg.url, timeout=cfg.timeout_seconds, max_bytes=cfg.max_response_bytes, accept="text/plain;version=0.0.4"
        )
        self._model_config = ModelConfig(cfg)
        self._events: KvEventSubscriber | None = None
        self._events_error: str | None = None
        kv_events, log_file = cfg.option("kv_events"), cfg.option("log_file")
        if kv_events:
            self._events = KvEventSubscriber(kv_events, cfg.option("kv_events_replay"))
            self._events.start()
        self._log = VllmLogReader(log_file) if log_file else None
        self._log_error: str | None = "not read yet" if log_file else None
        self._started_at: float | None = None  # the engine's process_start_time_seconds
        ledger = cfg.option("ledger")
        self._ledger = LedgerReader(ledger, cfg) if ledger else None
        self._ledger_error: str | None = "not read yet" if ledger else None

    def poll(self) -> EngineContribution:
        text = self._http.get_text()
        facts = vllm_facts_from_metrics(text, self.cfg, self._model_config.load())
        self._note_start_time(process_start_time(text))
        facts = self._merge_events(facts)
        facts = self._merge_log(facts)
        facts = self._merge_ledger(facts)
        return EngineContribution(facts)

    def _merge_ledger(self, facts: EngineFacts) -> EngineFacts:
        if self._ledger is None:
            return facts
        try:
            merged = merge_ledger(facts, self._ledger.read([p.id for p in facts.pools]))
        except SourceError as exc:
            self._ledger_error = f"{exc.reason}: {exc.message}"
            return facts  # the /metrics bounds, for every pool
        self._ledger_error = None
        return merged

    def _note_start_time(self, started_at: float | None) -> None:
        if started_at is None:
            return
        if self._events is not None and self._started_at is not None and started_at != self._started_at:
            self._events.engine_restarted(started_at)
        self._started_at = started_at

    def _merge_events(self, facts: EngineFacts) -> EngineFacts:
        if self._events is None:
            return facts
        ranks = [int(p.id) for p in facts.pools if p.id.isdigit()]
        self._events.ensure_ranks(ranks)
        snap = self._events.snapshot()
        pools = [
            dataclasses.replace(p, cached_blocks=snap.cached_blocks.get(int(p.id)) if p.id.isdigit() else None)
            for p in facts.pools
        ]
        return dataclasses.replace(facts, pools=pools, kv_events=dict(snap.events_by_type), kv_events_lost=snap.lost)

    def _merge_log(self, facts: EngineFacts) -> EngineFacts:
        if self._log is None:
            return facts
        try:
            log_facts = self._log.read()
        except OSError as exc:
            self._log_error = f"{self._log.path}: {exc.strerror or exc}"
            return facts
        terms = memory_terms(log_facts, facts.gpus or list(self.cfg.gpus))
        self._log_error = None if terms else f"{self._log.path}: no memory profile line found yet"
        return dataclasses.replace(facts, memory=list(facts.memory) + terms)

    def subsource_health(self) -> list[SubsourceReport]:
        """kv_events and log, for the configured sub-sources."""
        out: list[SubsourceReport] = []
        if self._events is not None:
            up, reason = self._events.health()
            out.append(SubsourceReport("kv_events", up, reason))
        if self._log is not None:
            message = self._log.unread_reason() if self._log_error == "not read yet" else self._log_error
            out.append(SubsourceReport("log", self._log_error is None, message))
        if self._ledger is not None:
            out.append(SubsourceReport("ledger", self._ledger_error is None, self._ledger_error))
        return out

    def close(self) -> None:
        self._http.abort()
        if self._ledger is not None:
            self._ledger.close()
        if self._events is not None:
            self._events.close()
            self._events = None
