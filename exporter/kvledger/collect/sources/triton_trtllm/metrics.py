"""Triton Inference Server's /metrics (port 8002) with the TensorRT-LLM backend, turned into
EngineFacts (pure: no I/O).

The backend's custom metrics (``inflight_batcher_llm/src/custom_metrics_reporter`` of
triton-inference-server/tensorrtllm_backend; docs/engines/triton-trtllm.md cites the
versions) are gauges with labels ``model`` and ``version`` plus one category label:

- ``nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type}``: ``max`` (capacity), ``free``,
  ``used``, ``tokens_per``; later builds add ``alloc_total``/``alloc_new``/``reused`` or
  ``reused``/``fraction`` (ignored);
- ``nv_trt_llm_request_metrics{request_type}``: ``active``, ``max``, ``scheduled``,
  ``context``; newer builds add ``waiting``;
- ``nv_trt_llm_runtime_memory_metrics{memory_type}``: ``cpu``, ``gpu``, ``pinned`` (bytes);
- ``nv_trt_llm_inflight_batcher_metrics{inflight_batcher_specific_metric}``: ``paused_requests``
  where the build has it.

The first releases named the families ``nv_trt_llm_*_statistics``; both spellings are read.
Each (model, version) with KV block metrics is one pool, named by the model (and
``model/version`` when one model is served in several versions). As for trtllm-serve,
``free`` includes reusable cached blocks: ``used`` is in-use exactly, ``free`` is free and
reclaimable together (``PoolFacts.unreferenced_blocks``).
"""

from __future__ import annotations

from kvledger.collect.sources.base import SourceError
from kvledger.collect.sources.metric_values import configured_block_bytes, count, series_text
from kvledger.collect.sources.prom_text import Exposition, Sample, parse_exposition
from kvledger.config.types import EngineConfig
from kvledger.domain.facts import EngineFacts, PoolFacts, RequestCounts
from kvledger.domain.limits import MAX_BLOCKS, MAX_SAFE_INT, MAX_TOKENS

KV = ("nv_trt_llm_kv_cache_block_metrics", "nv_trt_llm_kv_cache_block_statistics")
REQUESTS = ("nv_trt_llm_request_metrics", "nv_trt_llm_request_statistics")
MEMORY = ("nv_trt_llm_runtime_memory_metrics", "nv_trt_llm_runtime_memory_statistics")
IFB = ("nv_trt_llm_inflight_batcher_metrics", "nv_trt_llm_inflight_batcher_statistics")
CATEGORY = {KV: "kv_cache_block_type", REQUESTS: "request_type", MEMORY: "memory_type", IFB: "inflight_batcher_specific_metric"}
MEMORY_TYPES = ("gpu", "cpu", "pinned")
USED_CHECK = "kv_used_le_capacity"
PAUSED_CHECK = "paused_le_active"

Model = tuple[str, str]  # (model, version)


def _family(exp: Exposition, names: tuple[str, str]) -> tuple[str, dict[Model, dict[str, Sample]]]:
    """The family's samples by (model, version) and category value (newest spelling first)."""
    name = names[0] if names[0] in exp else names[1]
    label = CATEGORY[names]
    out: dict[Model, dict[str, Sample]] = {}
    for s in exp.get(name, []):
        key = (s.labels.get("model", ""), s.labels.get("version", ""))
        category = s.labels.get(label)
        if category is None:
            continue
        per_model = out.setdefault(key, {})
        if category in per_model:
            raise SourceError("parse", f"{series_text(name, s)}: a second series for the same model, version and {label}")
        per_model[category] = s
    return name, out


def triton_trtllm_facts(text: str | Exposition, cfg: EngineConfig) -> EngineFacts:
    exp = parse_exposition(text) if isinstance(text, str) else text
    kv_name, kv = _family(exp, KV)
    models = sorted(m for m, cats in kv.items() if "max" in cats)
    if not models:
        raise SourceError("missing", f"no {KV[0]}{{kv_cache_block_type=\"max\"}} series (is this Triton's metrics port, "
                                     "8002, serving a TensorRT-LLM model?)")
    req_name, req = _family(exp, REQUESTS)
    mem_name, mem = _family(exp, MEMORY)
    ifb_name, ifb = _family(exp, IFB)
    several_versions = len({m for m, _ in models}) < len(models)
    pools: list[PoolFacts] = []
    running_total: int | None = None
    waiting_total: int | None = None
    preempted_total: int | None = None
    max_seqs: int | None = None
    for model in models:
        cats = kv[model]
        c = count(kv_name, cats["max"], "number of blocks", 1, MAX_BLOCKS)
        if "tokens_per" not in cats:
            raise SourceError("missing", f"no kv_cache_block_type=\"tokens_per\" beside {series_text(kv_name, cats['max'])}")
        b = count(kv_name, cats["tokens_per"], "number of tokens", 1, MAX_TOKENS)
        if c * b > MAX_SAFE_INT:
            raise SourceError("parse", f"{series_text(kv_name, cats['max'])}: {c} blocks of {b} tokens exceeds {MAX_SAFE_INT} tokens")
        pool_id = f"{model[0]}/{model[1]}" if several_versions else (model[0] or "0")
        pool = PoolFacts(id=pool_id, block_size=b, num_blocks=c, block_bytes=configured_block_bytes(cfg, b, c))
        violations: list[str] = []
        if "used" in cats:
            used = count(kv_name, cats["used"], "number of blocks")
            if used > c:
                violations.append(USED_CHECK)
            else:
                pool.in_use = used
                pool.engine_reported_used_blocks = float(used)
                if "free" in cats:
                    pool.unreferenced_blocks = count(kv_name, cats["free"], "number of blocks")
        requests = req.get(model, {})
        active = count(req_name, requests["active"], "number of requests", 0, MAX_TOKENS) if "active" in requests else None
        paused_s = ifb.get(model, {}).get("paused_requests")
        paused = count(ifb_name, paused_s, "number of requests", 0, MAX_TOKENS) if paused_s is not None else None
        if active is not None:
            pool.running_requests = active  # the backend's active requests: running and paused alike
            if paused is not None and paused > active:
                violations.append(PAUSED_CHECK)
            else:
                running_total = (running_total or 0) + active - (paused or 0)
                if paused is not None:
                    preempted_total = (preempted_total or 0) + paused
        if "waiting" in requests:
            waiting_total = (waiting_total or 0) + count(req_name, requests["waiting"], "number of requests", 0, MAX_TOKENS)
        if "max" in requests:
            max_seqs = (max_seqs or 0) + count(req_name, requests["max"], "number of requests", 0, MAX_TOKENS)
        pool.source_violations = tuple(violations)
        pools.append(pool)

    memory: dict[str, int] = {}
    for model in models:
        for memory_type in MEMORY_TYPES:
            s = mem.get(model, {}).get(memory_type)
            if s is not None:
                memory[memory_type] = memory.get(memory_type, 0) + count(mem_name, s, "number of bytes")
                if memory[memory_type] > MAX_SAFE_INT:
                    raise SourceError("parse", f"{mem_name}{{memory_type=\"{memory_type}\"}}: the sum over models exceeds {MAX_SAFE_INT}")

    facts = EngineFacts(
        name=cfg.name,
        kind="triton-trtllm",
        source="triton-trtllm",
        pools=pools,
        request_counts=RequestCounts(running=running_total, waiting=waiting_total, preempted=preempted_total),
        reported_memory=memory,
    )
    facts.budgets.max_num_seqs = max_seqs if max_seqs is None or max_seqs <= MAX_TOKENS else None
    return facts
