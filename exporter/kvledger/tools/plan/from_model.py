"""A plan from a model's ``config.json`` (``plan_from_model``): a device (a GPU of ``GPUS``
or a memory size), tensor parallelism, KV dtype, block size, the scheduler's limits and the
memory terms the config cannot give (workspace peak, runtime buffers, reserve), each marked
``measured``, ``configured`` or ``estimate``. The shapes come from ``layers`` and ``weights``,
the block arithmetic from ``sizing``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvledger.collect.sources.model_config import load_model_config
from kvledger.domain.block_bytes import ModelConfigError, kv_shape
from kvledger.tools.plan.layers import layer_pools
from kvledger.tools.plan.report import GIB, GroupReport, PlanError, PoolReport, Report, Term, budget_verdict, terms_basis
from kvledger.tools.plan.sizing import (
    NULL_BLOCKS,
    GroupShape,
    engine_max_concurrency,
    engine_request_blocks,
    engine_token_capacity,
    expected_concurrency,
    kv_pool_left,
    layer_group_size,
    layer_groups,
    max_shape_request_blocks,
    pool_blocks,
    state_block_size,
    state_blocks_per_request,
    time_weighted_request_blocks,
    unified_pages,
    worst_case_concurrency,
)
from kvledger.tools.plan.weights import count_weights

#: Device memory by GPU name, from the vendors' datasheets. Vendors state HBM/GDDR
#: capacity in "GB" that are binary gigabytes (an H100's 80 GB is five 16 GiB HBM3
#: stacks), so the figures are GiB. NVML's total is a little lower (the driver and
#: ECC keep some; an H200 reports 143,771 MiB = 150,754,820,096 B with driver 580.159.04,
#: measured, against 141 GiB = 151,397,597,184 B here): pass --gpu-memory with NVML's total
#: (nvidia-smi --query-gpu=memory.total) for a tight check.
GPUS: dict[str, tuple[int, str]] = {
    "A10": (24 * GIB, "NVIDIA A10 datasheet: 24 GB GDDR6"),
    "L4": (24 * GIB, "NVIDIA L4 datasheet: 24 GB GDDR6"),
    "L40S": (48 * GIB, "NVIDIA L40S datasheet: 48 GB GDDR6 with ECC"),
    "A100-40GB": (40 * GIB, "NVIDIA A100 datasheet: 40 GB HBM2"),
    "A100-80GB": (80 * GIB, "NVIDIA A100 datasheet: 80 GB HBM2e"),
    "H100-80GB": (80 * GIB, "NVIDIA H100 datasheet (SXM5 and PCIe): 80 GB HBM3/HBM2e"),
    "H100-NVL": (94 * GIB, "NVIDIA H100 NVL datasheet: 94 GB HBM3"),
    "H200": (141 * GIB, "NVIDIA H200 datasheet: 141 GB HBM3e"),
    "B200": (180 * GIB, "NVIDIA DGX B200 datasheet: 1,440 GB over 8 GPUs (180 GB HBM3e each)"),
    "MI300X": (192 * GIB, "AMD Instinct MI300X datasheet: 192 GB HBM3"),
}

#: vLLM's API-server defaults on GPUs under 70 GiB (engine/arg_utils.py; larger GPUs get
#: 8192 and 1024): give the engine's own values
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_NUM_SEQS = 256


@dataclass(frozen=True)
class ModelPlanInput:
    config: str
    gpu: str | None = None
    gpu_memory: int | None = None
    tensor_parallel: int = 1
    kv_dtype: str = "auto"
    weights_dtype: str = "auto"
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int | None = None  # DEFAULT_MAX_NUM_BATCHED_TOKENS
    speculative_tokens: int = 0
    n: int = 1
    in_flight_batches: int = 1
    weights: Term | None = None  # overrides the counted weights
    workspace: Term | None = None
    runtime_buffers: Term | None = None
    reserve: Term | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    lengths: tuple[tuple[int, int, int], ...] = ()
    lengths_spec: str | None = None
    min_concurrency: int | None = None
    # linear-attention (Mamba-style) state layers: vLLM's --mamba-cache-dtype (conv state),
    # --mamba-ssm-cache-dtype (recurrent state; auto: the conv state's), and its mamba cache
    # mode: "align" with prefix caching (vLLM's default), "none" without
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    mamba_cache_mode: str = "align"


def device_memory(gpu: str | None, gpu_memory: int | None) -> tuple[int | None, dict[str, Any]]:
    if gpu is not None and gpu_memory is not None:
        raise PlanError("give --gpu or --gpu-memory, not both")
    if gpu is not None:
        key = {k.lower(): k for k in GPUS}.get(gpu.lower())
        if key is None:
            raise PlanError(f"--gpu {gpu!r}: unknown GPU (known: {', '.join(GPUS)}; or give --gpu-memory SIZE)")
        total, cite = GPUS[key]
        return total, {"name": key, "memory_bytes": total, "source": f"vendor figure: {cite}"}
    if gpu_memory is not None:
        return gpu_memory, {"name": None, "memory_bytes": gpu_memory, "source": "--gpu-memory"}
    return None, {"name": None, "memory_bytes": None, "source": None}


def plan_from_model(inp: ModelPlanInput) -> Report:
    try:
        cfg = load_model_config(inp.config)
        shape = kv_shape(cfg, inp.kv_dtype)
        pools = layer_pools(cfg, inp.kv_dtype, inp.tensor_parallel, mamba_cache_dtype=inp.mamba_cache_dtype,
                            mamba_ssm_cache_dtype=inp.mamba_ssm_cache_dtype, speculative_tokens=inp.speculative_tokens)
        weights = None if inp.weights is not None else count_weights(cfg, inp.tensor_parallel, inp.weights_dtype)
    except ModelConfigError as exc:
        raise PlanError(f"{inp.config}: {exc}") from None
    tp = inp.tensor_parallel
    b = inp.block_size
    max_len = inp.max_model_len or _max_position(cfg)
    if max_len is None:
        raise PlanError(f"{inp.config}: no max_position_embeddings; give --max-model-len")
    batched = inp.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
    in_flight = inp.in_flight_batches * batched
    total, device = device_memory(inp.gpu, inp.gpu_memory)

    # pools (layer types), their pages made equal, and the layer groups sharing one block pool
    if inp.mamba_cache_mode not in ("align", "none"):
        raise PlanError(f"mamba cache mode {inp.mamba_cache_mode!r}: expected align (prefix caching) or none")
    has_state = any(p.is_state for p in pools)
    b, pages = unified_pages(b, [None if p.is_state else p.bytes_per_layer_token_per_gpu for p in pools],
                             [p.state_bytes_per_layer_per_gpu for p in pools])
    layer_pool = [0] * sum(p.layers for p in pools)
    for index, p in enumerate(pools):
        for layer in p.layer_indices:
            layer_pool[layer] = index
    groups = [(k, list(v)) for k, v in layer_groups(layer_pool)]
    size = layer_group_size([p.layers for p in pools])
    state_blocks = state_blocks_per_request(inp.mamba_cache_mode, inp.speculative_tokens)
    shapes = [GroupShape(p.sliding_window, sum(1 for k, _v in groups if k == i), page.block_size,
                         state_blocks if p.is_state else None)
              for i, (p, page) in enumerate(zip(pools, pages, strict=True))]
    engine_block_per_gpu = max(len(layers) * pages[k].page_bytes for k, layers in groups)

    def at_cap(g: GroupShape) -> int:
        return max_shape_request_blocks([g], b, max_len, contexts=inp.n, speculative_slots=inp.speculative_tokens,
                                        in_flight_tokens=in_flight)

    pool_reports = []
    for p, g, page in zip(pools, shapes, pages, strict=True):
        per_token = None if p.is_state else p.bytes_per_token_per_gpu
        pool_reports.append(PoolReport(
            id=p.id, layers=p.layers, sliding_window=p.sliding_window, layer_groups=g.groups,
            bytes_per_token=None if per_token is None else per_token * tp, bytes_per_token_per_gpu=per_token,
            block_bytes=page.page_bytes * p.layers * tp, block_bytes_per_gpu=page.page_bytes * p.layers,
            blocks_per_request_at_cap=at_cap(g),
        ))
    group_reports = [
        GroupReport(
            index=i, pool=pools[k].id, kind=pools[k].kind, sliding_window=pools[k].sliding_window, layers=layers,
            padding_layers=size - len(layers), page_bytes_per_gpu=pages[k].page_bytes,
            block_size=state_block_size(b, inp.mamba_cache_mode, max_len) if pools[k].is_state else pages[k].block_size,
            page_padding_bytes_per_gpu=pages[k].padding_bytes, state_bytes_per_gpu=pools[k].state_bytes_per_layer_per_gpu,
            blocks_per_request_at_cap=at_cap(dataclasses.replace(shapes[k], groups=1)),
        )
        for i, (k, layers) in enumerate(groups)
    ]
    per_request = max_shape_request_blocks(shapes, b, max_len, contexts=inp.n, speculative_slots=inp.speculative_tokens,
                                           in_flight_tokens=in_flight)

    # the budget, per GPU
    terms: list[Term] = []
    if inp.weights is not None:
        terms.append(Term("weights", inp.weights.bytes, inp.weights.source))
    else:
        assert weights is not None
        terms.append(Term("weights", weights.bytes_per_gpu, "counted"))
    for t in (inp.workspace, inp.runtime_buffers):
        if t is not None:
            terms.append(t)
    reserve = inp.reserve
    if inp.gpu_memory_utilization is not None:
        if reserve is not None:
            raise PlanError("give --reserve or --gpu-memory-utilization, not both")
        if total is None:
            raise PlanError("--gpu-memory-utilization needs the device's memory (--gpu or --gpu-memory)")
        if not 0 < inp.gpu_memory_utilization <= 1:
            raise PlanError(f"--gpu-memory-utilization {inp.gpu_memory_utilization}: expected a fraction in (0, 1]")
        reserve = Term("reserve", total - math.ceil(total * inp.gpu_memory_utilization), "configured")
    if reserve is not None:
        terms.append(reserve)
    unknown = [c for c, t in (("workspace", inp.workspace), ("runtime_buffers", inp.runtime_buffers),
                              ("reserve", reserve)) if t is None]
    if inp.kv_cache_memory_bytes is not None:
        kv_bytes: int | None = inp.kv_cache_memory_bytes
        kv_source = "configured"
        kv_basis = "hard"
        unknown_for_kv: list[str] = unknown if total is not None else []
    elif total is None:
        raise PlanError("give the device (--gpu NAME or --gpu-memory SIZE) or the KV pool (--kv-cache-memory-bytes)")
    else:
        known = {t.category: t.bytes for t in terms}
        kv_bytes = kv_pool_left(total, known) if not unknown else None
        kv_source = "derived"
        kv_basis = terms_basis(terms)
        unknown_for_kv = unknown
    if kv_bytes is not None:
        terms.append(Term("kv_pool", max(0, kv_bytes), kv_source))
    min_kv = (per_request + NULL_BLOCKS) * engine_block_per_gpu

    kv: dict[str, Any] = {
        "pool_bytes_per_gpu": kv_bytes, "pool_source": kv_source, "basis": kv_basis,
        "block_size": b, "layer_group_size": size, "layer_groups": len(groups),
        "block_bytes_per_gpu": engine_block_per_gpu, "block_bytes": engine_block_per_gpu * tp,
        "blocks_per_request_at_cap": per_request, "min_pool_bytes_per_gpu": min_kv,
    }
    concurrency: dict[str, Any] = {"reserve_cap": None, "dynamic": None}
    extra: list[tuple[str, str]] = []
    if kv_bytes is not None:
        blocks = pool_blocks(kv_bytes, engine_block_per_gpu)
        usable = max(0, blocks - NULL_BLOCKS)
        # tokens when every block holds tokens of one attention group; with state groups a
        # request also holds state blocks, so only the engine's own figure is given
        token_capacity = None if has_state else usable // len(groups) * b
        engine_request = engine_request_blocks(shapes, b, max_len, in_flight)
        kv.update(num_blocks=blocks, usable_blocks=usable, token_capacity=token_capacity,
                  engine_blocks_per_request_at_max_model_len=engine_request,
                  engine_max_concurrency=round(engine_max_concurrency(blocks, engine_request), 6),
                  engine_token_capacity=engine_token_capacity(blocks, engine_request, max_len))
        worst = worst_case_concurrency(usable, per_request, inp.max_num_seqs)
        fit = worst_case_concurrency(usable, per_request, None)
        concurrency["reserve_cap"] = {
            "requests": worst, "limited_by": "max_num_seqs" if fit >= inp.max_num_seqs else "kv_pool",
            "blocks_per_request": per_request, "basis": kv_basis,
            "max_num_seqs_at_cap_fits": fit >= inp.max_num_seqs,
        }
        if inp.lengths:
            try:
                mean = time_weighted_request_blocks(shapes, inp.lengths, b, max_len, contexts=inp.n,
                                                    speculative_slots=inp.speculative_tokens)
            except ValueError as exc:
                raise PlanError(f"length distribution: {exc}") from None
            expected = expected_concurrency(usable, mean, inp.max_num_seqs)
            concurrency["dynamic"] = {
                "requests": expected,
                "limited_by": "max_num_seqs" if expected == inp.max_num_seqs else "kv_pool",
                "mean_blocks_per_request": round(mean, 3), "lengths": inp.lengths_spec,
                "entries": sum(c for _p, _o, c in inp.lengths), "basis": "estimate",
            }
        if inp.min_concurrency is not None and worst < inp.min_concurrency:
            extra.append(("kv_pool", f"admits {worst} requests at their cap under reserve-cap, "
                                     f"below --min-concurrency {inp.min_concurrency}"))
    verdict = budget_verdict(total, terms, unknown_for_kv, min_kv, kv_bytes, extra)
    notes = [f"KV cache elements of {shape.dtype_bytes} byte(s) (--kv-dtype {inp.kv_dtype})"]
    if weights is not None:
        notes.append(f"weights counted from {Path(inp.config).name}: {weights.params:,} parameters, {weights.dtype}"
                     + (f", {weights.quantization}" if weights.quantization else ""))
    padded = sum(g.padding_layers for g in group_reports)
    if padded:
        notes.append(f"{padded} padding layer(s): every layer group has {size} layers")
    for p, page in zip(pools, pages, strict=True):
        if p.is_state and p.state_bytes_per_layer_per_gpu is not None:
            raised = f"attention block size {b} tokens (from --block-size {inp.block_size}) so that o" if b != inp.block_size else "o"
            notes.append(
                f"{raised}ne attention page ({page.page_bytes:,} B per layer per GPU) holds one {p.id} state "
                f"({p.state_bytes_per_layer_per_gpu:,} B), padded by {100 * page.padding_bytes / p.state_bytes_per_layer_per_gpu:.2f} %"
            )
        elif page.padding_bytes:
            notes.append(f"{p.id}: pages padded by {page.padding_bytes:,} B to the largest page ({page.page_bytes:,} B)")
    plan_shapes: dict[str, Any] = {
        "tensor_parallel": tp, "kv_dtype": inp.kv_dtype, "block_size": inp.block_size, "max_model_len": max_len,
        "max_num_seqs": inp.max_num_seqs, "max_num_batched_tokens": batched,
        "speculative_tokens": inp.speculative_tokens, "n": inp.n,
        "in_flight_batches": inp.in_flight_batches, "in_flight_tokens": in_flight,
    }
    if has_state:
        plan_shapes.update(mamba_cache_dtype=inp.mamba_cache_dtype, mamba_ssm_cache_dtype=inp.mamba_ssm_cache_dtype,
                           mamba_cache_mode=inp.mamba_cache_mode)
    return Report(
        origin="model",
        source=inp.config,
        device=device,
        shapes=plan_shapes,
        weights=None if weights is None else {
            "bytes_per_gpu": weights.bytes_per_gpu, "bytes": weights.bytes, "params": weights.params,
            "dtype": weights.dtype, "quantization": weights.quantization, "source": "counted",
            "parts": [dataclasses.asdict(p) for p in weights.parts],
        },
        pools=pool_reports,
        terms=terms,
        unknown_terms=unknown,
        kv=kv,
        concurrency=concurrency,
        verdict=verdict,
        notes=notes,
        groups=group_reports,
    )


def _max_position(cfg: Mapping[str, Any]) -> int | None:
    inner = cfg.get("text_config") if "num_hidden_layers" not in cfg else cfg
    value = (inner if isinstance(inner, Mapping) else cfg).get("max_position_embeddings")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
