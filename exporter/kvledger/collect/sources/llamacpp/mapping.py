"""llama.cpp's slots, props and metrics -> EngineFacts (pure: no I/O besides an optional
model config). The policy turns these facts into numbers; nothing here computes one.

The KV cache of llama.cpp holds one cell per token and per layer group: the pool's block
is one token (``block_size`` 1). Each slot is one KV sequence. Two layouts:

- **split** (``-np N`` without ``--kv-unified``, kvledger's default): every slot owns
  ``n_ctx`` cells of its own stream. Capacity is the sum of the slots' ``n_ctx``; a busy
  slot holds its whole context for its request, so the engine's reservation is the sum of
  the busy slots' ``n_ctx`` (``PoolFacts.reserved_blocks``, exact under both sharing rules:
  no cell is shared between slots, ``shared`` 0; admission reserve-cap).
- **unified** (``--kv-unified``, also llama-server's default when ``-np`` is not given;
  configure ``kv_unified: true``): the slots share one buffer and each slot's ``n_ctx`` is
  that buffer, unless capped (the model's training context, ``--kv-unified-per-slot``):
  then ``kv_size`` gives the buffer. Capacity is the largest slot ``n_ctx`` (or
  ``kv_size``); reservations are only bounded (by the policy: busy slots x ``n_ctx``);
  the engine admits dynamically.

Physical state (current builds, ``n_prompt_tokens`` per slot): tokens of busy slots are
in use (their requests reference them); tokens an idle slot keeps for prompt reuse are
reclaimable (cached, no request references them); the rest is free. A slot that never ran
a task holds none. A slot whose token count is not reported (builds before the count,
e.g. those with the KV gauges) leaves the sum it belongs to unknown. A slot that claims
more tokens than its context is impossible: in-use and reclaimable are then left unknown
and the check ``slot_tokens_le_n_ctx`` is reported violated.

Old builds' ``kv_cache_usage_ratio`` (used cells over the context) becomes the engine's
own used-blocks claim (``engine_reported_used_blocks``: cells of busy and idle slots
alike); a ratio outside [0, 1] is left unknown (check ``kv_cache_usage_in_range``).

While the server sleeps (``/props`` ``is_sleeping``) the model and its KV cache are
unloaded: no pool is reported (and /slots is not read, since reading it wakes the model).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvledger.collect.sources.base import SourceError
from kvledger.collect.sources.llamacpp.documents import Props, Slot
from kvledger.collect.sources.llamacpp.metrics import ServerMetrics
from kvledger.collect.sources.model_config import load_model_config
from kvledger.config.types import EngineConfig
from kvledger.domain.block_bytes import ModelConfigError, kv_shape
from kvledger.domain.facts import EngineFacts, PoolFacts, RequestCounts
from kvledger.domain.limits import MAX_BLOCKS, MAX_SAFE_INT

POOL = "0"
TOKENS_CHECK = "slot_tokens_le_n_ctx"
USAGE_CHECK = "kv_cache_usage_in_range"


def slot_tokens(slot: Slot) -> int | None:
    """Tokens in the slot's KV sequence: reported, 0 for a slot that never ran a task,
    None when the server does not say."""
    if slot.tokens is not None:
        return slot.tokens
    return 0 if slot.task is None else None


def _sum(values: Sequence[int | None]) -> int | None:
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


def _block_bytes(cfg: EngineConfig, model_config: Mapping[str, Any] | None) -> int | None:
    """Bytes of one token's KV over all layers: configured, or derived from the model."""
    if cfg.block_bytes is not None:
        return cfg.block_bytes
    if cfg.model is None:
        return None
    try:
        data = model_config if model_config is not None else load_model_config(cfg.model.config)
        return kv_shape(data, cfg.model.kv_dtype).block_bytes(1, cfg.model.tensor_parallel)
    except ModelConfigError as exc:
        raise SourceError("config", f"engine {cfg.name!r}: model.config: {exc}") from None


def _capacity(slots: Sequence[Slot], unified: bool, cfg: EngineConfig) -> int:
    """The pool in tokens: split, the slots' n_ctx added up; unified, the slots' n_ctx (each
    may use the whole buffer); ``kv_size`` when configured, never below what the slots show."""
    shown = max(s.n_ctx for s in slots) if unified else sum(s.n_ctx for s in slots)
    if shown > MAX_BLOCKS:
        raise SourceError("schema", f"/slots: the slots' contexts add up to {shown} tokens, more than {MAX_BLOCKS}")
    configured = cfg.option("kv_size")
    if configured is None:
        return shown
    size = int(configured)
    if size < shown:
        what = "a slot's context" if unified else "the slots' contexts added up"
        raise SourceError("config", f"engine {cfg.name!r}: kv_size {size} is smaller than {what} ({shown} tokens)")
    return size


def _pool(slots: Sequence[Slot], unified: bool, metrics: ServerMetrics | None, block_bytes: int | None,
          cfg: EngineConfig) -> PoolFacts:
    capacity = _capacity(slots, unified, cfg)
    if block_bytes is not None and not 1 <= block_bytes <= MAX_SAFE_INT // capacity:
        raise SourceError(
            "config", f"engine {cfg.name!r}: {block_bytes} bytes per token over {capacity} tokens is not a capacity in "
            f"[1, {MAX_SAFE_INT}] bytes"
        )
    busy = [s for s in slots if s.processing]
    violations: list[str] = []
    in_use = _sum([slot_tokens(s) for s in busy])
    reclaimable = _sum([slot_tokens(s) for s in slots if not s.processing])
    if any((t := slot_tokens(s)) is not None and t > s.n_ctx for s in slots):
        violations.append(TOKENS_CHECK)  # more tokens than the slot's context: impossible
        in_use = reclaimable = None
    claim = None
    if metrics is not None and metrics.kv_usage_ratio is not None:
        if 0.0 <= metrics.kv_usage_ratio <= 1.0:
            claim = metrics.kv_usage_ratio * capacity
        else:
            violations.append(USAGE_CHECK)
    return PoolFacts(
        id=POOL,
        block_size=1,
        num_blocks=capacity,
        block_bytes=block_bytes,
        in_use=in_use,
        reclaimable=reclaimable,
        engine_reported_used_blocks=claim,
        running_requests=len(busy),
        reserved_blocks=None if unified else sum(s.n_ctx for s in busy),
        # split slots are separate streams: no cell is shared, so the slots' reservation is
        # exact under reference-aware sharing too (unified: sequences may share cells)
        shared=None if unified else 0,
        source_violations=tuple(violations),
    )


def llamacpp_facts(
    slots: Sequence[Slot] | None,
    props: Props,
    metrics: ServerMetrics | None,
    cfg: EngineConfig,
    model_config: Mapping[str, Any] | None = None,
) -> EngineFacts:
    """EngineFacts from a llama.cpp server's /slots (None while it sleeps), /props and
    /metrics (None when not read). ``cfg.option("kv_unified")`` picks the layout."""
    unified = cfg.option("kv_unified") == "true"
    facts = EngineFacts(
        name=cfg.name,
        kind="llamacpp",
        source="llamacpp",
        version=props.build_info,
        # unified slots share one buffer: admission is dynamic; otherwise the kind's default
        # (reserve-cap) applies in the merge, where a configured value wins
        admission="dynamic" if unified else None,
    )
    counters: dict[str, float] = {}
    if metrics is not None and metrics.prompt_tokens_cached is not None:
        counters["prefix_cache_hit_tokens"] = metrics.prompt_tokens_cached
        if metrics.prompt_tokens is not None:
            # every prompt is looked up in the slot's cache: evaluated + reused
            counters["prefix_cache_queried_tokens"] = metrics.prompt_tokens + metrics.prompt_tokens_cached
    facts.counters = counters
    waiting = None if metrics is None else metrics.deferred
    if slots is None:  # asleep: nothing loaded, nothing running
        facts.request_counts = RequestCounts(running=0, waiting=waiting)
        return facts
    pool = _pool(slots, unified, metrics, _block_bytes(cfg, model_config), cfg)
    facts.pools = [pool]
    facts.budgets.max_model_len = max(s.n_ctx for s in slots)  # no request outgrows its slot
    facts.budgets.max_num_seqs = len(slots)
    facts.request_counts = RequestCounts(running=pool.running_requests, waiting=waiting)
    return facts
