"""SGLang's /metrics (``--enable-metrics``) turned into EngineFacts (pure: no I/O).

Names and meanings are those of SGLang's scheduler metrics collector (docs/engines/sglang.md
cites the files). SGLang counts its KV pool in TOKEN slots; a page holds ``page_size`` tokens
and is kvledger's block. Two generations of names are understood:

- current builds: ``sglang:kv_available_tokens`` (free slots), ``sglang:kv_evictable_tokens``
  (radix-cached slots no request holds: reclaimable) and ``sglang:kv_used_tokens`` (the rest:
  SGLang computes it as ``max_total_num_tokens - (available + evictable)``), with
  ``sglang:page_size``, ``sglang:num_pages`` and ``sglang:context_len``; hybrid models add the
  ``sglang:swa_*`` (sliding-window) and ``sglang:mamba_*`` (state slots) triples, each its own
  pool (never summed into the full-attention one);
- older builds: only ``sglang:num_used_tokens`` (= capacity - (available + evictable), so
  evictable tokens count as unused) and ``sglang:token_usage``. In-use pages are exact;
  free and reclaimable are known only together (each bounded above by the unused pages).

``sglang:max_total_num_tokens`` (capacity in tokens) is required. Per data-parallel rank
(``dp_rank``) the series of the lowest ``tp_rank``/``pp_rank``/``moe_ep_rank`` is read (every TP
rank reports the same pool: counted once, never summed); per-priority series (``priority``
label) are ignored where the total is present. ``sglang:cache_hit_rate`` is ignored (zeroed at
decode logs): prefix-cache figures come from ``sglang:realtime_tokens_total{mode}``, else the
tokenizer's ``sglang:prompt_tokens_total``/``sglang:cached_tokens_total``. Retractions
(``sglang:num_retracted_requests_total``) are preemptions. HiCache's
``sglang:evicted_tokens_total`` (GPU to host) and ``sglang:load_back_tokens_total`` are kept.

Impossible readings leave the dependent facts unknown and name the violated check in
``PoolFacts.source_violations``: the three kv_* triples not adding up to the pool, token
counts not whole pages, in-use tokens above capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvledger.collect.sources.base import SourceError
from kvledger.collect.sources.metric_values import configured_block_bytes, count, number, ratio, series_text, small_int_label
from kvledger.collect.sources.prom_text import Exposition, Sample, parse_exposition
from kvledger.config.types import EngineConfig
from kvledger.domain.facts import EngineFacts, PoolFacts, RequestCounts
from kvledger.domain.limits import MAX_BLOCKS, MAX_SAFE_INT, MAX_TOKENS

P = "sglang:"
CAPACITY = P + "max_total_num_tokens"
PAGE_SIZE = P + "page_size"
NUM_PAGES = P + "num_pages"
CONTEXT_LEN = P + "context_len"
NUM_USED = P + "num_used_tokens"
SWA_USAGE = P + "swa_token_usage"
RUNNING = P + "num_running_reqs"
QUEUED = P + "num_queue_reqs"
RETRACTED = P + "num_retracted_requests_total"
REALTIME = P + "realtime_tokens_total"
PROMPT_TOKENS = P + "prompt_tokens_total"
CACHED_TOKENS = P + "cached_tokens_total"
HOST_OFFLOADED = P + "evicted_tokens_total"
HOST_LOADED = P + "load_back_tokens_total"
#: the (available, evictable, used) token triples of each pool, and the pool id suffix
TRIPLES = {
    "full": (P + "kv_available_tokens", P + "kv_evictable_tokens", P + "kv_used_tokens"),
    "swa": (P + "swa_available_tokens", P + "swa_evictable_tokens", P + "swa_used_tokens"),
    "mamba": (P + "mamba_available_tokens", P + "mamba_evictable_tokens", P + "mamba_used_tokens"),
}

RANK_LABELS = ("tp_rank", "pp_rank", "moe_ep_rank")
DP_LABEL = "dp_rank"
MAX_RANK = 1023
#: checks this adapter reports violated (PoolFacts.source_violations)
SUM_CHECK = "kv_tokens_sum_to_capacity"
PAGE_CHECK = "kv_tokens_whole_pages"
USED_CHECK = "num_used_tokens_le_capacity"


def _rank_key(name: str, s: Sample) -> tuple[int, ...]:
    return tuple(small_int_label(name, s, label, MAX_RANK) for label in RANK_LABELS)


def _dp(name: str, s: Sample) -> int:
    return small_int_label(name, s, DP_LABEL, MAX_RANK)


def _total_series(samples: list[Sample]) -> list[Sample]:
    """The total series where per-priority ones are also exposed (priority="" or no label)."""
    totals = [s for s in samples if s.labels.get("priority", "") == ""]
    return totals or samples


def _per_rank(exp: Exposition, name: str, extra: str | None = None) -> dict[tuple[int, str], Sample]:
    """One sample per (dp rank, value of ``extra``): the lowest TP/PP/EP rank's."""
    out: dict[tuple[int, str], tuple[tuple[int, ...], Sample]] = {}
    for s in _total_series(exp.get(name, [])):
        key = (_dp(name, s), s.labels.get(extra, "") if extra else "")
        rank = _rank_key(name, s)
        if key not in out or rank < out[key][0]:
            out[key] = (rank, s)
    return {k: v[1] for k, v in out.items()}


def _gauge(exp: Exposition, name: str, dp: int) -> Sample | None:
    return _per_rank(exp, name).get((dp, ""))


def _sum_counter(exp: Exposition, name: str, extra: str | None = None, only: str | None = None) -> float | None:
    """A counter summed over data-parallel ranks (one TP rank each); ``only`` keeps one ``extra`` value."""
    picked = [s for (_, e), s in _per_rank(exp, name, extra).items() if only is None or e == only]
    if not picked:
        return None
    return _bounded_sum(name, [number(name, s) for s in picked])


def _sum_all(exp: Exposition, name: str) -> float | None:
    """A tokenizer counter (one process, no rank labels): every series summed."""
    found = exp.get(name)
    return None if not found else _bounded_sum(name, [number(name, s) for s in found])


def _bounded_sum(name: str, values: list[float]) -> float:
    total = sum(values)
    if total > MAX_SAFE_INT:
        raise SourceError("parse", f"{name}: the sum over its series, {total!r}, exceeds {MAX_SAFE_INT}")
    return total


@dataclass(frozen=True)
class _Pages:
    page: int  # tokens per page (block)
    pages: int  # capacity in pages


def _pool(
    pool_id: str,
    triple: tuple[Sample | None, Sample | None, Sample | None],
    names: tuple[str, str, str],
    pages: _Pages | None,
    capacity_tokens: int | None,
    block_size: int,
) -> PoolFacts | None:
    """A pool from its (available, evictable, used) token triple. ``pages`` gives the
    capacity (the full pool); without it the capacity is the triple's sum (SGLang computes
    ``used = size - (available + evictable)`` for every pool), absent when that is 0."""
    avail_s, evict_s, used_s = triple
    if avail_s is None or evict_s is None or used_s is None:
        return None
    avail = count(names[0], avail_s, "number of tokens")
    evict = count(names[1], evict_s, "number of tokens")
    used = count(names[2], used_s, "number of tokens")
    total = avail + evict + used
    violations: list[str] = []
    if pages is not None:
        num_blocks, page = pages.pages, pages.page
        if capacity_tokens is not None and total != capacity_tokens:
            violations.append(SUM_CHECK)
    else:
        page = block_size
        if total == 0:
            return None  # a build that emits the hybrid gauges as zeros for a plain model
        num_blocks = total // page
        if num_blocks < 1 or num_blocks > MAX_BLOCKS:
            raise SourceError("parse", f"{series_text(names[0], avail_s)}: the {pool_id} pool of {total} tokens "
                                       f"is not 1 .. {MAX_BLOCKS} pages of {page} tokens")
    if avail % page or evict % page:
        violations.append(PAGE_CHECK)
    claim = used / page if used <= num_blocks * page else None
    if violations:
        return PoolFacts(id=pool_id, block_size=page, num_blocks=num_blocks, engine_reported_used_blocks=claim,
                         source_violations=tuple(violations))
    free, reclaimable = avail // page, evict // page
    in_use = num_blocks - free - reclaimable
    if in_use < 0:
        return PoolFacts(id=pool_id, block_size=page, num_blocks=num_blocks, engine_reported_used_blocks=claim,
                         source_violations=(SUM_CHECK,))
    return PoolFacts(id=pool_id, block_size=page, num_blocks=num_blocks, in_use=in_use, reclaimable=reclaimable,
                     free=free, engine_reported_used_blocks=claim)


def _pages(exp: Exposition, dp: int, capacity: int, page_hint: int | None) -> _Pages:
    page_s = _gauge(exp, PAGE_SIZE, dp)
    page = count(PAGE_SIZE, page_s, "number of tokens", 1, MAX_TOKENS) if page_s is not None else (page_hint or 1)
    pages_s = _gauge(exp, NUM_PAGES, dp)
    pages = count(NUM_PAGES, pages_s, "number of pages", 0, MAX_BLOCKS) if pages_s is not None else capacity // page
    if pages < 1 or pages > capacity // page:
        where = series_text(NUM_PAGES, pages_s) if pages_s is not None else f"{CAPACITY} // page_size"
        raise SourceError("parse", f"{where}: {pages} pages of {page} tokens do not fit {CAPACITY}={capacity} (at least one page)")
    if pages > MAX_BLOCKS or pages * page > MAX_SAFE_INT:
        raise SourceError("parse", f"{CAPACITY}={capacity} tokens in pages of {page} exceeds {MAX_BLOCKS} pages")
    return _Pages(page, pages)


def sglang_facts(text: str | Exposition, cfg: EngineConfig, page_size: int | None = None) -> EngineFacts:
    """EngineFacts from SGLang's /metrics. ``page_size``: from /get_server_info, used when the
    exposition has no ``sglang:page_size`` (older builds); SGLang's default is 1."""
    exp = parse_exposition(text) if isinstance(text, str) else text
    capacities = _per_rank(exp, CAPACITY)
    if not capacities:
        raise SourceError("missing", f"no {CAPACITY} series (is this SGLang's /metrics, started with --enable-metrics?)")
    pools: list[PoolFacts] = []
    running_total: int | None = None
    waiting_total: int | None = None
    max_model_len: int | None = None
    for dp, _ in sorted(capacities):  # pools: "<dp rank>" (full attention), "<dp rank>/swa", "<dp rank>/mamba"
        cap_s = capacities[(dp, "")]
        capacity = count(CAPACITY, cap_s, "number of tokens", 1, MAX_SAFE_INT)
        pages = _pages(exp, dp, capacity, page_size)
        triple_of = {kind: (_gauge(exp, names[0], dp), _gauge(exp, names[1], dp), _gauge(exp, names[2], dp))
                     for kind, names in TRIPLES.items()}
        full = _pool(str(dp), triple_of["full"], TRIPLES["full"], pages, capacity, pages.page)
        if full is None:
            full = _old_build_pool(exp, dp, pages, capacity)
        full.block_bytes = configured_block_bytes(cfg, pages.page, pages.pages)
        running_s = _gauge(exp, RUNNING, dp)
        if running_s is not None:
            running = count(RUNNING, running_s, "number of requests", 0, MAX_TOKENS)
            full.running_requests = running
            running_total = (running_total or 0) + running
        queued_s = _gauge(exp, QUEUED, dp)
        if queued_s is not None:
            waiting_total = (waiting_total or 0) + count(QUEUED, queued_s, "number of requests", 0, MAX_TOKENS)
        context_s = _gauge(exp, CONTEXT_LEN, dp)
        if context_s is not None:
            length = count(CONTEXT_LEN, context_s, "number of tokens", 1, MAX_TOKENS)
            max_model_len = length if max_model_len is None else min(max_model_len, length)
        pools.append(full)
        for kind, block_size in (("swa", pages.page), ("mamba", 1)):
            pool = _pool(f"{dp}/{kind}", triple_of[kind], TRIPLES[kind], None, None, block_size)
            if pool is not None:
                pools.append(pool)

    counters: dict[str, float] = {}
    retracted = _sum_counter(exp, RETRACTED)
    if retracted is not None:
        counters["preemptions"] = retracted
    cache_hit = _sum_counter(exp, REALTIME, "mode", "prefill_cache")
    compute = _sum_counter(exp, REALTIME, "mode", "prefill_compute")
    if cache_hit is not None and compute is not None:
        counters["prefix_cache_queried_tokens"] = cache_hit + compute
        counters["prefix_cache_hit_tokens"] = cache_hit
    else:
        prompt, cached = _sum_all(exp, PROMPT_TOKENS), _sum_all(exp, CACHED_TOKENS)
        if prompt is not None and cached is not None:
            counters["prefix_cache_queried_tokens"] = prompt
            counters["prefix_cache_hit_tokens"] = cached
    for counter, name in (("host_offloaded_tokens", HOST_OFFLOADED), ("host_loaded_tokens", HOST_LOADED)):
        value = _sum_counter(exp, name)
        if value is not None:
            counters[counter] = value

    facts = EngineFacts(
        name=cfg.name,
        kind="sglang",
        source="sglang",
        pools=pools,
        request_counts=RequestCounts(running=running_total, waiting=waiting_total, preempted=None),
        counters=counters,
    )
    facts.budgets.max_model_len = max_model_len
    return facts


def _old_build_pool(exp: Exposition, dp: int, pages: _Pages, capacity: int) -> PoolFacts:
    """Builds without the kv_* triple: ``num_used_tokens`` = capacity - (available + evictable).
    In-use pages exact, free and reclaimable known only together (unreferenced pages). On a
    hybrid sliding-window model (``swa_token_usage`` above 0) num_used is max(full, swa): not
    this pool's, so nothing physical is known."""
    pool = PoolFacts(id=str(dp), block_size=pages.page, num_blocks=pages.pages)
    used_s = _gauge(exp, NUM_USED, dp)
    swa_s = _gauge(exp, SWA_USAGE, dp)
    if used_s is None or (swa_s is not None and ratio(SWA_USAGE, swa_s) > 0):
        return pool
    used = count(NUM_USED, used_s, "number of tokens")
    unused = capacity - used
    if unused < 0:
        pool.source_violations = (USED_CHECK,)
        return pool
    pool.engine_reported_used_blocks = used / pages.page if used <= pages.pages * pages.page else None
    if unused % pages.page or unused // pages.page > pages.pages:
        pool.source_violations = (PAGE_CHECK,)
        return pool
    pool.unreferenced_blocks = unused // pages.page
    pool.in_use = pages.pages - pool.unreferenced_blocks
    return pool
