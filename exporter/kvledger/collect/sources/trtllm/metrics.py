"""trtllm-serve's ``GET /prometheus/metrics`` turned into EngineFacts (pure: no I/O).

Names are those of TensorRT-LLM's ``tensorrt_llm/metrics/collector.py`` (prefix ``trtllm_``,
labels ``model_name`` and ``engine_type``; docs/engines/trtllm.md cites the file):
``trtllm_kv_cache_max_blocks`` (capacity), ``trtllm_kv_cache_used_blocks``,
``trtllm_kv_cache_free_blocks``, ``trtllm_kv_cache_tokens_per_block``,
``trtllm_num_requests_running`` (the executor's active requests), ``trtllm_num_requests_waiting``,
``trtllm_num_paused_requests``, ``trtllm_max_num_active_requests``,
``trtllm_max_num_tokens_runtime`` and ``trtllm_{gpu,cpu,pinned}_memory_usage_bytes``.
Builds that export only ``trtllm_kv_cache_utilization`` (a ratio with no capacity) fail with
``SourceError("missing")`` saying what is needed. Never poll trtllm-serve's JSON ``/metrics``:
each read removes the iteration statistics it returns.

TensorRT-LLM's free blocks are its free queue, which holds reusable cached blocks too:
``used`` is in-use (referenced) blocks exactly, ``free`` is free and reclaimable together
(``PoolFacts.unreferenced_blocks``). A used count above capacity or paused requests above
active ones leave the dependent facts unknown (``PoolFacts.source_violations``).

Several label sets (``engine_type``) are several pools, named by it; one is pool ``0``.
"""

from __future__ import annotations

from kvledger.collect.sources.base import SourceError
from kvledger.collect.sources.metric_values import configured_block_bytes, count, series_text
from kvledger.collect.sources.prom_text import Exposition, Sample, parse_exposition
from kvledger.config.types import EngineConfig
from kvledger.domain.facts import EngineFacts, PoolFacts, RequestCounts
from kvledger.domain.limits import MAX_BLOCKS, MAX_SAFE_INT, MAX_TOKENS

MAX_BLOCKS_NAME = "trtllm_kv_cache_max_blocks"
FREE = "trtllm_kv_cache_free_blocks"
USED = "trtllm_kv_cache_used_blocks"
TOKENS_PER_BLOCK = "trtllm_kv_cache_tokens_per_block"
UTILIZATION = "trtllm_kv_cache_utilization"
RUNNING = "trtllm_num_requests_running"
WAITING = "trtllm_num_requests_waiting"
PAUSED = "trtllm_num_paused_requests"
MAX_ACTIVE = "trtllm_max_num_active_requests"
MAX_TOKENS_RUNTIME = "trtllm_max_num_tokens_runtime"
MEMORY = {
    "gpu": "trtllm_gpu_memory_usage_bytes",
    "cpu": "trtllm_cpu_memory_usage_bytes",
    "pinned": "trtllm_pinned_memory_usage_bytes",
}
GROUP_LABEL = "engine_type"
USED_CHECK = "kv_used_le_capacity"
PAUSED_CHECK = "paused_le_active"


def _by_group(exp: Exposition, name: str) -> dict[str, Sample]:
    """The one sample of ``name`` per ``engine_type``; two samples in one group are an error."""
    out: dict[str, Sample] = {}
    for s in exp.get(name, []):
        group = s.labels.get(GROUP_LABEL, "")
        if group in out:
            raise SourceError("parse", f"{series_text(name, s)}: a second series for {GROUP_LABEL}={group!r} "
                                       f"(one engine per label set expected)")
        out[group] = s
    return out


def trtllm_facts(text: str | Exposition, cfg: EngineConfig) -> EngineFacts:
    exp = parse_exposition(text) if isinstance(text, str) else text
    capacities = _by_group(exp, MAX_BLOCKS_NAME)
    if not capacities:
        if UTILIZATION in exp:
            raise SourceError("missing", f"no {MAX_BLOCKS_NAME}: this TensorRT-LLM exports only {UTILIZATION} (a ratio, "
                                         "no capacity); kvledger needs the trtllm_kv_cache_* block gauges of a newer "
                                         "trtllm-serve with iteration stats on (enable_iter_perf_stats)")
        raise SourceError("missing", f"no {MAX_BLOCKS_NAME} series (is this trtllm-serve's GET /prometheus/metrics, "
                                     "with iteration stats on?)")
    per = {name: _by_group(exp, name) for name in (FREE, USED, TOKENS_PER_BLOCK, RUNNING, WAITING, PAUSED,
                                                    MAX_ACTIVE, MAX_TOKENS_RUNTIME)}
    pools: list[PoolFacts] = []
    running_total: int | None = None
    waiting_total: int | None = None
    preempted_total: int | None = None
    max_seqs: int | None = None
    max_tokens: int | None = None
    for group in sorted(capacities):
        pool_id = "0" if len(capacities) == 1 else (group or "0")
        c = count(MAX_BLOCKS_NAME, capacities[group], "number of blocks", 1, MAX_BLOCKS)
        tpb_s = per[TOKENS_PER_BLOCK].get(group)
        if tpb_s is None:
            raise SourceError("missing", f"no {TOKENS_PER_BLOCK} beside {series_text(MAX_BLOCKS_NAME, capacities[group])}")
        b = count(TOKENS_PER_BLOCK, tpb_s, "number of tokens", 1, MAX_TOKENS)
        if c * b > MAX_SAFE_INT:
            raise SourceError("parse", f"{MAX_BLOCKS_NAME}={c} blocks of {b} tokens exceeds {MAX_SAFE_INT} tokens")
        pool = PoolFacts(id=pool_id, block_size=b, num_blocks=c, block_bytes=configured_block_bytes(cfg, b, c))
        violations: list[str] = []
        used_s, free_s = per[USED].get(group), per[FREE].get(group)
        if used_s is not None:
            used = count(USED, used_s, "number of blocks")
            if used > c:
                violations.append(USED_CHECK)
            else:
                pool.in_use = used
                pool.engine_reported_used_blocks = float(used)
                if free_s is not None:
                    pool.unreferenced_blocks = count(FREE, free_s, "number of blocks")
        active_s, paused_s = per[RUNNING].get(group), per[PAUSED].get(group)
        active = count(RUNNING, active_s, "number of requests", 0, MAX_TOKENS) if active_s is not None else None
        paused = count(PAUSED, paused_s, "number of requests", 0, MAX_TOKENS) if paused_s is not None else None
        if active is not None:
            pool.running_requests = active  # admitted: running and paused alike
            if paused is not None and paused > active:
                violations.append(PAUSED_CHECK)
            else:
                running_total = (running_total or 0) + active - (paused or 0)
                if paused is not None:
                    preempted_total = (preempted_total or 0) + paused
        waiting_s = per[WAITING].get(group)
        if waiting_s is not None:
            waiting_total = (waiting_total or 0) + count(WAITING, waiting_s, "number of requests", 0, MAX_TOKENS)
        if (s := per[MAX_ACTIVE].get(group)) is not None:
            max_seqs = (max_seqs or 0) + count(MAX_ACTIVE, s, "number of requests", 0, MAX_TOKENS)
        if (s := per[MAX_TOKENS_RUNTIME].get(group)) is not None:
            value = count(MAX_TOKENS_RUNTIME, s, "number of tokens", 0, MAX_TOKENS)
            max_tokens = value if max_tokens is None else min(max_tokens, value)
        pool.source_violations = tuple(violations)
        pools.append(pool)

    memory: dict[str, int] = {}
    for memory_type, name in MEMORY.items():
        found = exp.get(name, [])
        if found:
            total = sum(count(name, s, "number of bytes") for s in found)
            if total > MAX_SAFE_INT:
                raise SourceError("parse", f"{name}: {total} bytes in all exceeds {MAX_SAFE_INT}")
            memory[memory_type] = total

    facts = EngineFacts(
        name=cfg.name,
        kind="trtllm",
        source="trtllm",
        pools=pools,
        request_counts=RequestCounts(running=running_total, waiting=waiting_total, preempted=preempted_total),
        reported_memory=memory,
    )
    facts.budgets.max_num_seqs = max_seqs if max_seqs is None or max_seqs <= MAX_TOKENS else None
    facts.budgets.max_num_batched_tokens = max_tokens
    return facts

