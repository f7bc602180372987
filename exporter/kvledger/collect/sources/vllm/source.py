"""The ``kind: vllm`` source: /metrics, plus optional KV events (ZMQ), startup log and ledger.

``poll()`` GETs ``cfg.url`` (bounded by ``cfg.timeout_seconds`` as a total deadline),
maps it with ``vllm_facts_from_metrics`` and merges the secondary sub-sources:
- KV events: ``pool.cached_blocks`` per DP rank (None while the count cannot be trusted),
  ``kv_events`` by type and ``kv_events_lost``;
- startup log: measured memory terms per GPU;
- the in-engine ledger (``ledger:``, sources/vllm/engine_documents.py): exact pools and
  requests in place of the /metrics bounds, all ranks or none.
With a ledger, /metrics and the ledger are read side by side, each on its own deadline
(the ledger in a thread of this source): the ledger's ranks come from the last
``cache_config_info`` /metrics gave (or, before that and while /metrics is down, from
probing the ledger's addresses), so a slow, failing or incomplete /metrics (a fresh
data-parallel engine has no usage gauge for a rank that has not served a request yet)
never hides the exact pools; each part ends ``HAND_OVER_SECONDS`` before the engine's
timeout, so that the poll as a whole meets it. Then /metrics is a sub-source too
(``metrics``): the poll fails only when neither gives facts.
A change of ``process_start_time_seconds`` (the API server's own series) between two
polls means the engine restarted: the KV-event count of the old run is dropped then, even
before the new run publishes anything (an idle restarted engine publishes nothing).
Trouble in a sub-source never fails the poll; ``subsource_health()`` reports it.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from kvledger.collect.sources.base import EngineContribution, Source, SourceError, SubsourceReport
from kvledger.collect.sources.http_client import HttpClient
from kvledger.collect.sources.model_config import ModelConfig
from kvledger.collect.sources.prom_text import parse_exposition
from kvledger.collect.sources.vllm.engine_documents import CacheShape, RankFactsReader, merge_rank_facts
from kvledger.collect.sources.vllm.events_subscriber import KvEventSubscriber
from kvledger.collect.sources.vllm.metrics import vllm_facts_from_metrics
from kvledger.collect.sources.vllm.startup_log import VllmLogReader, memory_terms
from kvledger.config.types import EngineConfig
from kvledger.domain.facts import FULL_ATTENTION, MAMBA, SLIDING_WINDOW, EngineFacts, KvGroupFacts, PoolFacts

#: with a ledger, /metrics and the ledger each get the engine's timeout less this (at most
#: half of it): the collector's deadline for the whole poll is that timeout, and merging the
#: two and handing the ledger's thread over must fit in it (a poll that succeeds a moment
#: after the deadline would be marked down, its facts dropped, and up again)
HAND_OVER_SECONDS = 0.2


def part_timeout(timeout: float) -> float:
    """The deadline of /metrics and of the ledger, each, when both are read."""
    return max(timeout / 2, timeout - HAND_OVER_SECONDS)

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
        ledger = cfg.option("ledger")
        self._part_timeout = part_timeout(cfg.timeout_seconds) if ledger else cfg.timeout_seconds
        self._http = HttpClient(
            cfg.url, timeout=self._part_timeout, max_bytes=cfg.max_response_bytes, max_lines=cfg.max_response_lines,
            accept="text/plain;version=0.0.4",
            auth=cfg.client_auth,
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
        self._ledger = RankFactsReader(ledger, cfg, self._part_timeout) if ledger else None
        self._ledger_error: str | None = "not read yet" if ledger else None
        self._metrics_error: str | None = "not read yet" if ledger else None
        # the ledger's ranks: cache_config_info's of the last /metrics that had it, and whether
        # that was the last poll's (else the reader probes for ranks beyond them)
        self._ranks: tuple[str, ...] = ()
        self._ranks_current = False
        self._ledger_pool = ThreadPoolExecutor(1, thread_name_prefix=f"kvledger-ledger-{cfg.name}") if ledger else None
        self._ledger_read: Future[dict[str, EngineFacts]] | None = None

    def poll(self) -> EngineContribution:
        if self._ledger is None:
            deadline = time.monotonic() + self.cfg.timeout_seconds  # the collector's, for the parse too
            text = self._http.get_text()
            facts = vllm_facts_from_metrics(parse_exposition(text, deadline), self.cfg, self._model_config.load())
            self._note_start_time(process_start_time(text))
        else:
            facts = self._poll_with_ledger(self._ledger)
        facts = self._merge_events(facts)
        facts = self._merge_log(facts)
        return EngineContribution(facts)

    def _poll_with_ledger(self, ledger: RankFactsReader) -> EngineFacts:
        """/metrics here and the ledger in its thread, side by side; the ledger's pools when
        it answered for every rank, else the /metrics bounds; SourceError (the /metrics one)
        when neither gave facts."""
        began = time.monotonic()
        read = self._start_ledger_read(ledger)
        metrics: EngineFacts | None = None
        metrics_error: SourceError | None = None
        shape: CacheShape | None = None
        try:
            text = self._http.get_text()
            self._note_start_time(process_start_time(text))
            exposition = parse_exposition(text, began + self._part_timeout)
            shape = CacheShape.of_metrics(exposition)
            metrics = vllm_facts_from_metrics(exposition, self.cfg, self._model_config.load())
        except SourceError as exc:
            metrics_error = exc
        self._metrics_error = None if metrics_error is None else f"{metrics_error.reason}: {metrics_error.message}"
        if shape is not None:
            self._ranks, self._ranks_current = shape.ranks, True
        else:
            self._ranks_current = False
        facts: EngineFacts | None = None
        try:
            rank_facts = self._finish_ledger_read(read, began)
            if shape is not None:
                ledger.check_ranks(shape.ranks)
            base = metrics if metrics is not None else EngineFacts(name=self.cfg.name, kind="vllm", source="vllm")
            facts = merge_rank_facts(base, rank_facts, shape)
        except SourceError as exc:
            self._ledger_error = f"{exc.reason}: {exc.message}"
        else:
            self._ledger_error = None
        if facts is not None:
            return facts
        if metrics is None:
            assert metrics_error is not None
            raise metrics_error
        return metrics  # the /metrics bounds, for every pool

    def _start_ledger_read(self, ledger: RankFactsReader) -> Future[dict[str, EngineFacts]] | None:
        """This poll's read, begun now; None while an earlier poll's read still runs (its
        answer would be older than this poll: it is never used, and this poll has none)."""
        earlier = self._ledger_read
        if earlier is not None and not earlier.done():
            return None
        assert self._ledger_pool is not None
        read = self._ledger_pool.submit(ledger.read, self._ranks, not self._ranks_current)
        self._ledger_read = read
        return read

    def _finish_ledger_read(self, read: Future[dict[str, EngineFacts]] | None, began: float) -> dict[str, EngineFacts]:
        if read is None:
            raise SourceError("timeout", f"ledger: the read of an earlier poll is still running (over {self._part_timeout:g}s)")
        left = began + self._part_timeout + HAND_OVER_SECONDS / 2 - time.monotonic()
        try:
            return read.result(timeout=max(0.0, left))
        except FutureTimeout:
            raise SourceError("timeout", f"ledger: no answer within {self._part_timeout:g}s") from None

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
            _with_event_groups(
                dataclasses.replace(p, cached_blocks=snap.cached_blocks.get(int(p.id)) if p.id.isdigit() else None),
                snap.groups.get(int(p.id)) if p.id.isdigit() else None,
            )
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
        """kv_events, log, and ledger with metrics (/metrics itself, beside the ledger), for the
        configured sub-sources."""
        out: list[SubsourceReport] = []
        if self._events is not None:
            up, reason = self._events.health()
            out.append(SubsourceReport("kv_events", up, reason))
        if self._log is not None:
            message = self._log.unread_reason() if self._log_error == "not read yet" else self._log_error
            out.append(SubsourceReport("log", self._log_error is None, message))
        if self._ledger is not None:
            out.append(SubsourceReport("ledger", self._ledger_error is None, self._ledger_error,
                                       self._ledger.document_age()))
            out.append(SubsourceReport("metrics", self._metrics_error is None, self._metrics_error))
        return out

    def close(self) -> None:
        self._http.abort()
        if self._ledger is not None:
            self._ledger.close()
        if self._ledger_pool is not None:
            self._ledger_pool.shutdown(wait=False, cancel_futures=True)
        if self._events is not None:
            self._events.close()
            self._events = None


#: a Mamba group's blocks per request as the stock path bounds them: vLLM's align mode (the
#: mode prefix caching, and so KV events, runs Mamba in) keeps the running state, the last
#: block-aligned one and a prefill checkpoint; speculative blocks are not counted
STOCK_STATE_BLOCKS = 3


def _with_event_groups(pool: PoolFacts, seen: dict[int, tuple[str | None, int | None]] | None) -> PoolFacts:
    """A pool the in-engine ledger does not state, given the KV-cache groups its KV events
    named (``group_idx``, ``kv_cache_spec_kind``): one group per index up to the largest
    seen, a sliding window as its events say, a Mamba group its state blocks, every other
    kind (and an index no event named yet) full attention, one block per token, the most
    any attention group takes; the reservation bound then covers every group."""
    if pool.groups or not seen or (max(seen) == 0 and seen[0][0] in (None, "full_attention", "mla_attention")):
        return pool
    groups = []
    for idx in range(max(seen) + 1):
        kind, window = seen.get(idx, (None, None))
        if kind in ("sliding_window", "sliding_window_mla") and window is not None:
            groups.append(KvGroupFacts(str(idx), SLIDING_WINDOW, window=window))
        elif kind == "mamba":
            groups.append(KvGroupFacts(str(idx), MAMBA, state_blocks=STOCK_STATE_BLOCKS))
        else:
            groups.append(KvGroupFacts(str(idx), FULL_ATTENTION))
    return dataclasses.replace(pool, groups=tuple(groups), layer_groups=max(pool.layer_groups, len(groups)))
