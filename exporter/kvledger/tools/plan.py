"""`kvledger plan`: does a deployment's device budget close at its maximum shapes?

Two inputs, one report:

- ``plan_from_model``: a model's ``config.json``, a device (a GPU of ``GPUS`` or a memory
  size), tensor parallelism, KV dtype, block size, the scheduler's limits and the memory
  terms the config cannot give (workspace peak, runtime buffers, reserve), each marked
  ``measured``, ``configured`` or ``estimate``;
- ``plan_from_live``: a running kvledger's JSON view or /metrics, whose measured terms
  and configuration replace the derivations.

The arithmetic lives in ``policy.py`` (budget, blocks, concurrency) and ``block_bytes.py``
(shapes, weights); this module gathers inputs, calls them and renders the report (a
table for people, JSON for tools). Every figure carries its basis: ``hard`` when every
term under it is measured, configured or counted, ``estimate`` when one is an estimate.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvledger.model.block_bytes import (
    ModelConfigError,
    count_weights,
    kv_shape,
    layer_pools,
    load_model_config,
)
from kvledger.model.facts import TERM_SOURCES
from kvledger.policy.arithmetic import ceil_div
from kvledger.policy.sizing import (
    NULL_BLOCKS,
    PLAN_TERM_ORDER,
    GroupShape,
    breaking_term,
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

GIB = 1 << 30

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

#: where a plan's figure comes from: the budget's own sources, "counted" (from the config's
#: shapes: weights) and "derived" (the KV pool left)
PLAN_SOURCES = (*TERM_SOURCES, "counted", "derived")


class PlanError(ValueError):
    """The plan's inputs cannot give an answer; the message names the bad input."""


@dataclass(frozen=True, slots=True)
class Term:
    """One memory term of the device budget, per GPU, with where its figure comes from."""

    category: str
    bytes: int
    source: str  # measured | configured | estimate | counted | derived


def parse_term(text: str, option: str) -> Term:
    """``SIZE:SOURCE`` (``3GiB:measured``); the source must be given: an unmarked figure
    could be read as a measurement."""
    from kvledger.config.loader import parse_size

    size, sep, source = text.rpartition(":")
    if not sep or source not in TERM_SOURCES:
        raise PlanError(f"{option} {text!r}: expected SIZE:SOURCE with SOURCE one of {', '.join(TERM_SOURCES)} "
                        f"(e.g. 3GiB:measured)")
    try:
        value = parse_size(size)
    except ValueError as exc:
        raise PlanError(f"{option} {text!r}: {exc}") from None
    return Term(option.removeprefix("--").replace("-", "_"), value, source)


def parse_lengths(specs: Sequence[str], file: str | None) -> list[tuple[int, int, int]]:
    """A length distribution: ``PROMPT:OUTPUT`` entries (``--length``, each one request)
    and/or a file of lines ``PROMPT OUTPUT [COUNT]`` ('#' starts a comment)."""
    out: list[tuple[int, int, int]] = []
    for spec in specs:
        parts = spec.split(":")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise PlanError(f"--length {spec!r}: expected PROMPT:OUTPUT tokens, e.g. 1000:200")
        out.append((int(parts[0]), int(parts[1]), 1))
    if file is not None:
        try:
            text = Path(file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise PlanError(f"--lengths-file {file}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
        for number, line in enumerate(text.splitlines(), start=1):
            fields = line.split("#", 1)[0].replace(",", " ").split()
            if not fields:
                continue
            if len(fields) not in (2, 3) or not all(f.isdigit() for f in fields):
                raise PlanError(f"{file}:{number}: expected 'PROMPT OUTPUT [COUNT]' (non-negative integers), got {line.strip()!r}")
            out.append((int(fields[0]), int(fields[1]), int(fields[2]) if len(fields) == 3 else 1))
    return out


# ---------------------------------------------------------------- the report


@dataclass
class PoolReport:
    id: str
    layers: int | None
    sliding_window: int | None
    layer_groups: int | None
    bytes_per_token: int | None  # all layers of the pool, all TP ranks
    bytes_per_token_per_gpu: int | None
    block_bytes: int  # one block of the pool's layers, all TP ranks
    block_bytes_per_gpu: int | None
    blocks_per_request_at_cap: int | None


@dataclass
class GroupReport:
    """One KV-cache group as vLLM forms it: a block table over some layers of one type."""

    index: int
    pool: str  # the layer type's pool id (full, sliding-W, linear-attention)
    kind: str  # full_attention | sliding_attention | linear_attention
    sliding_window: int | None
    layers: list[int]  # the model's layer indices in this group
    padding_layers: int  # layers the group lacks to the group size
    block_size: int  # tokens per block (a state group: the attention block size)
    page_bytes_per_gpu: int  # one block of one of its layers on one GPU (padded)
    page_padding_bytes_per_gpu: int
    state_bytes_per_gpu: int | None  # one sequence's state of one layer (state groups)
    blocks_per_request_at_cap: int


@dataclass
class Report:
    origin: str  # "model" or "live"
    source: str  # the config path or the URL
    device: dict[str, Any]
    shapes: dict[str, Any]
    weights: dict[str, Any] | None
    pools: list[PoolReport]
    terms: list[Term]
    unknown_terms: list[str]
    kv: dict[str, Any]
    concurrency: dict[str, Any]
    verdict: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    groups: list[GroupReport] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "origin": self.origin,
            "source": self.source,
            "device": self.device,
            "shapes": self.shapes,
            "weights": self.weights,
            "pools": [dataclasses.asdict(p) for p in self.pools],
            "kv_cache_groups": [dataclasses.asdict(g) for g in self.groups],
            "budget": {
                "per_gpu": True,
                "terms": [dataclasses.asdict(t) for t in self.terms],
                "unknown_terms": self.unknown_terms,
            },
            "kv": self.kv,
            "concurrency": self.concurrency,
            "verdict": self.verdict,
            "notes": self.notes,
        }


def _basis(terms: Sequence[Term]) -> str:
    return "estimate" if any(t.source == "estimate" for t in terms) else "hard"


def _verdict(
    total: int | None,
    terms: list[Term],
    unknown: list[str],
    min_kv_bytes: int,
    kv_bytes: int | None,
    extra_failures: Sequence[tuple[str, str]] = (),
) -> dict[str, Any]:
    """Whether weights + workspace + runtime_buffers + reserve + kv_pool <= total closes with
    a KV pool that holds one request at its cap (and the null block), and if not, which term
    breaks it."""
    by = {t.category: t.bytes for t in terms}
    estimates = sorted({t.category for t in terms if t.source == "estimate"})
    failures: list[tuple[str, str]] = []
    if total is None:
        closes: bool | None = None
        message = "no device memory given (--gpu or --gpu-memory): the budget inequality is not checked"
    elif unknown:
        closes = None
        message = f"cannot decide: {', '.join(unknown)} not given (SIZE:measured, :configured or :estimate)"
        failures.append((unknown[0], "not given"))
    else:
        term = breaking_term(total, by)
        kv = by.get("kv_pool", 0)
        if term is not None:
            closes = False
            message = (f"{' + '.join(f'{c} {_gib(by[c])}' for c in PLAN_TERM_ORDER if c in by)} "
                       f"= {_gib(sum(by.values()))} exceeds the device's {_gib(total)}; {term} breaks it")
            failures.append((term, "exceeds the device"))
        elif kv < min_kv_bytes:
            closes = False
            message = (f"the KV pool ({_gib(kv)} per GPU) cannot hold one request at its cap "
                       f"({_gib(min_kv_bytes)} with the null block); kv_pool breaks it")
            failures.append(("kv_pool", "below one request at its cap"))
        else:
            closes = True
            if (kv_bytes is not None and "kv_pool" in by and total - sum(by.values()) > 0) or min_kv_bytes == 0:
                message = f"slack {_gib(total - sum(by.values()))} per GPU beside the KV pool"
            else:
                message = (f"the KV pool left ({_gib(kv)} per GPU) holds one request at its cap "
                           f"({_gib(min_kv_bytes)}) and more")
    if kv_bytes is not None and kv_bytes < min_kv_bytes and not failures:
        closes = False
        message = (f"the KV pool ({_gib(kv_bytes)} per GPU) cannot hold one request at its cap "
                   f"({_gib(min_kv_bytes)}); kv_pool breaks it")
        failures.append(("kv_pool", "below one request at its cap"))
    for term, why in extra_failures:
        failures.append((term, why))
        if closes is not False:
            closes = False
            message = f"{why}; {term} breaks it"
    if closes and estimates:
        message += f"; rests on estimates ({', '.join(estimates)}): not a hard guarantee"
    elif closes is False and estimates and total is not None and not extra_failures:
        # a failure rests on the estimates when the other terms alone would close
        derived = any(t.category == "kv_pool" and t.source == "derived" for t in terms)
        hard = {c: b for c, b in by.items() if c not in estimates and not (derived and c == "kv_pool")}
        pool = total - sum(hard.values()) if derived else by.get("kv_pool", 0)
        if breaking_term(total, hard) is None and pool >= min_kv_bytes:
            message += f"; rests on estimates ({', '.join(estimates)}): without them it would close"
    return {
        "closes": closes,
        "breaking_term": failures[0][0] if failures else None,
        "failures": [{"term": t, "why": w} for t, w in failures],
        "rests_on_estimates": estimates,
        "message": message,
    }


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


# ---------------------------------------------------------------- from a model config


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
        kv_basis = _basis(terms)
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
    verdict = _verdict(total, terms, unknown_for_kv, min_kv, kv_bytes, extra)
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


# ---------------------------------------------------------------- from a running kvledger


Samples = dict[str, list[tuple[dict[str, str], float]]]


def parse_live(body: bytes, where: str) -> Samples:
    """kvledger's JSON view (``/api/v1/accounts``) or its /metrics text, as samples by name, under
    this version's names (a 0.1.0 daemon's renamed families and labels are read too)."""
    return _current_names(_parse_live(body, where))


def _current_names(samples: Samples) -> Samples:
    from kvledger.output.catalog import RENAMED_FAMILIES, RENAMED_LABELS

    out: Samples = {}
    for name, items in samples.items():
        new = RENAMED_FAMILIES.get(name, name)
        moved = {old: label for (family, old), label in RENAMED_LABELS.items() if family == new}
        out.setdefault(new, []).extend(({moved.get(k, k): v for k, v in lab.items()}, value) for lab, value in items)
    return out


def _parse_live(body: bytes, where: str) -> Samples:
    text = body.decode("utf-8", "replace")
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
            metrics = data["metrics"]
            return {name: [(dict(s["labels"]), float(s["value"])) for s in items] for name, items in metrics.items()}
        except (ValueError, KeyError, TypeError) as exc:
            raise PlanError(f"{where}: not kvledger's JSON view ({type(exc).__name__}: {exc})") from None
    from kvledger.collect.sources.base import SourceError
    from kvledger.collect.sources.prom_text import parse_exposition

    try:
        exp = parse_exposition(text)
    except SourceError as exc:
        raise PlanError(f"{where}: {exc.message}") from None
    return {name: [(dict(s.labels), s.value) for s in items] for name, items in exp.items()}


def fetch_live(url: str, timeout: float = 5.0) -> bytes:
    from kvledger.collect.sources.base import SourceError
    from kvledger.collect.sources.http_client import HttpClient

    try:
        return HttpClient(url, timeout=timeout, accept="application/json, text/plain").get()
    except SourceError as exc:
        raise PlanError(f"--from: {exc.message}") from None
    except ValueError as exc:
        raise PlanError(f"--from {url!r}: {exc}") from None


def _pick(samples: Samples, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
    return [(lab, v) for lab, v in samples.get(name, []) if all(lab.get(k) == v2 for k, v2 in labels.items())]


def _one(samples: Samples, name: str, **labels: str) -> float | None:
    found = _pick(samples, name, **labels)
    return found[0][1] if found else None


def plan_from_live(
    samples: Samples,
    where: str,
    engine: str | None = None,
    lengths: tuple[tuple[int, int, int], ...] = (),
    lengths_spec: str | None = None,
    min_concurrency: int | None = None,
) -> Report:
    """The same report from a running kvledger: its measured budget terms, capacity and
    configuration, and whether it still closes if every admitted request reaches its cap."""
    engines = sorted({lab["engine"] for lab, _v in samples.get("kvledger_kv_capacity_blocks", []) if "engine" in lab})
    if not engines:
        raise PlanError(f"{where}: no kvledger_kv_capacity_blocks series (is this kvledger's /metrics or JSON view?)")
    if engine is None:
        if len(engines) > 1:
            raise PlanError(f"{where}: {len(engines)} engines ({', '.join(engines)}): pick one with --engine")
        engine = engines[0]
    elif engine not in engines:
        raise PlanError(f"--engine {engine!r}: not among {', '.join(engines)}")
    max_len = _one(samples, "kvledger_max_model_len_tokens", engine=engine)
    if max_len is None:
        raise PlanError(f"{where}: engine {engine!r} exports no kvledger_max_model_len_tokens (set max_model_len in its config)")
    max_seqs = _one(samples, "kvledger_max_running_requests", engine=engine)
    batched = _one(samples, "kvledger_iteration_budget_tokens", engine=engine)
    L = int(max_len)
    pools: list[PoolReport] = []
    usable_total = 0
    per_request_total = 0
    blocks_for_admitted = 0
    capacity_bytes_total = 0
    b0 = None
    for lab, cap in sorted(_pick(samples, "kvledger_kv_capacity_blocks", engine=engine), key=lambda s: s[0].get("pool", "")):
        pool = lab.get("pool", "0")
        b = _one(samples, "kvledger_kv_block_size_tokens", engine=engine, pool=pool)
        cap_bytes = _one(samples, "kvledger_kv_capacity_bytes", engine=engine, pool=pool)
        if b is None or cap_bytes is None or cap <= 0:
            raise PlanError(f"{where}: engine {engine!r} pool {pool!r} lacks its block size or capacity bytes")
        block_bytes = int(cap_bytes) // int(cap)
        at_cap = int(ceil_div(L, int(b)))
        pools.append(PoolReport(
            id=pool, layers=None, sliding_window=None, layer_groups=None,
            bytes_per_token=block_bytes // int(b) if block_bytes % int(b) == 0 else None, bytes_per_token_per_gpu=None,
            block_bytes=block_bytes, block_bytes_per_gpu=None, blocks_per_request_at_cap=at_cap,
        ))
        usable_total += int(cap)
        per_request_total = max(per_request_total, at_cap)
        capacity_bytes_total += int(cap_bytes)
        b0 = int(b)
    assert b0 is not None
    admitted = sum(int(v) for lab, v in _pick(samples, "kvledger_requests", engine=engine)
                   if lab.get("state") in ("running", "preempted"))
    admission = next((lab.get("admission") for lab, _v in _pick(samples, "kvledger_policy_info", engine=engine)), None)
    reserved = {lab.get("basis", "exact"): v for lab, v in _pick(samples, "kvledger_kv_reserved_blocks", engine=engine)}
    # every admitted request at its cap: the exact reservation (each request's own cap, the
    # declared sharing rule) where the daemon knows it, else its upper bound, else L each
    if "exact" in reserved:
        blocks_for_admitted, at_cap_basis = int(reserved["exact"]), "exact: the requests' own caps"
    elif "upper_bound" in reserved:
        blocks_for_admitted, at_cap_basis = int(reserved["upper_bound"]), "upper bound: max_model_len each"
    else:
        blocks_for_admitted, at_cap_basis = admitted * per_request_total, "upper bound: max_model_len each"

    # budget terms of this engine's GPUs, as the daemon exports them
    budget = _pick(samples, "kvledger_gpu_budget_bytes", engine=engine)
    gpus = sorted({lab["gpu"] for lab, _v in budget if "gpu" in lab}, key=lambda g: (len(g), g))
    gpu = gpus[0] if gpus else None
    terms: list[Term] = []
    total = None
    if gpu is not None:
        for category in PLAN_TERM_ORDER:
            for lab, v in budget:
                if lab.get("gpu") == gpu and lab.get("category") == category:
                    terms.append(Term(category, int(v), lab.get("provenance", "measured")))
        others = [(lab, v) for lab, v in samples.get("kvledger_gpu_budget_bytes", [])
                  if lab.get("gpu") == gpu and lab.get("engine") != engine]
        if others:
            sources = {lab.get("provenance", "measured") for lab, _v in others}
            source = "estimate" if "estimate" in sources else ("measured" if sources == {"measured"} else "configured")
            terms.insert(-1 if terms and terms[-1].category == "kv_pool" else len(terms),
                         Term("other_engines", int(sum(v for _l, v in others)), source))
        t = _one(samples, "kvledger_gpu_memory_total_bytes", gpu=gpu)
        total = None if t is None else int(t)
    unknown = [c for c in PLAN_TERM_ORDER if c != "other_engines" and c not in {t.category for t in terms}]
    extra: list[tuple[str, str]] = []
    if blocks_for_admitted > usable_total:
        meaning = {"dynamic": "; under dynamic admission an overcommit: the engine preempts as they grow",
                   "reserve-cap": "; under reserve-cap a broken promise"}.get(admission or "", "")
        extra.append(("kv_pool", f"cannot hold the {admitted} admitted requests at their cap "
                                 f"({blocks_for_admitted:,} blocks > capacity {usable_total:,}){meaning}"))
    worst = worst_case_concurrency(usable_total, per_request_total, None if max_seqs is None else int(max_seqs))
    if min_concurrency is not None and worst < min_concurrency:
        extra.append(("kv_pool", f"admits {worst} requests at their cap under reserve-cap, below --min-concurrency {min_concurrency}"))
    kv_term = next((t for t in terms if t.category == "kv_pool"), None)
    if usable_total < per_request_total:
        extra.append(("kv_pool", f"cannot hold one request at its cap ({per_request_total} blocks > capacity {usable_total})"))
    verdict = _verdict(total, terms, [u for u in unknown if u != "reserve" or total is None], 0, None, extra)
    if "reserve" in unknown and verdict["closes"] is not None:
        verdict["message"] += "; no reserve declared (memory.reserve_bytes)"
    concurrency: dict[str, Any] = {
        "reserve_cap": {"requests": worst, "blocks_per_request": per_request_total, "basis": "hard",
                        "limited_by": "max_num_seqs" if max_seqs is not None and worst == int(max_seqs) else "kv_pool"},
        "dynamic": None,
        "admitted_now": admitted,
        "admitted_at_cap_blocks": blocks_for_admitted,
        "admitted_at_cap_basis": at_cap_basis,
        "admitted_at_cap_fits": blocks_for_admitted <= usable_total,
        "reserved_blocks_now": reserved or None,
    }
    if lengths:
        try:
            mean = time_weighted_request_blocks([GroupShape(None, 1)], lengths, b0, L)
        except ValueError as exc:
            raise PlanError(f"length distribution: {exc}") from None
        expected = expected_concurrency(usable_total, mean, None if max_seqs is None else int(max_seqs))
        concurrency["dynamic"] = {
            "requests": expected,
            "limited_by": "max_num_seqs" if max_seqs is not None and expected == int(max_seqs) else "kv_pool",
            "mean_blocks_per_request": round(mean, 3), "lengths": lengths_spec,
            "entries": sum(c for _p, _o, c in lengths), "basis": "estimate",
        }
    return Report(
        origin="live",
        source=where,
        device={"name": None, "gpu": gpu, "memory_bytes": total, "source": "NVML (measured)" if total is not None else None},
        shapes={"engine": engine, "admission": admission, "block_size": b0, "max_model_len": L,
                "max_num_seqs": None if max_seqs is None else int(max_seqs),
                "max_num_batched_tokens": None if batched is None else int(batched)},
        weights=None,
        pools=pools,
        terms=terms,
        unknown_terms=unknown,
        kv={"pool_bytes_per_gpu": kv_term.bytes if kv_term else None, "pool_source": kv_term.source if kv_term else None,
            "basis": "hard", "usable_blocks": usable_total, "capacity_bytes": capacity_bytes_total,
            "block_size": b0, "token_capacity": int(sum(v for _l, v in _pick(samples, "kvledger_kv_capacity_tokens", engine=engine)))
            or usable_total * b0, "blocks_per_request_at_cap": per_request_total},
        concurrency=concurrency,
        verdict=verdict,
        notes=[f"engine {engine!r} as its kvledger exports it: capacity and budget terms are live"],
    )


# ---------------------------------------------------------------- rendering


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n:,} B ({n / GIB:.2f} GiB)" if n >= GIB // 16 else f"{n:,} B"


def render_table(r: Report) -> str:
    out: list[str] = []
    add = out.append
    if r.origin == "model":
        add(f"plan for {r.source}")
    else:
        add(f"plan from the live kvledger at {r.source} (engine {r.shapes.get('engine')})")
    dev = r.device
    if dev.get("memory_bytes") is not None:
        add(f"device: {dev.get('name') or ('GPU ' + str(dev['gpu']) if dev.get('gpu') is not None else 'GPU')}"
            f" {_size(dev['memory_bytes'])} [{dev['source']}]")
    shapes = ", ".join(f"{k}={v}" for k, v in r.shapes.items() if v is not None)
    add(f"shapes: {shapes}")
    if r.weights is not None:
        w = r.weights
        add(f"weights: {_size(w['bytes_per_gpu'])} per GPU, {w['params']:,} parameters ({w['dtype']}"
            + (f", {w['quantization']}" if w["quantization"] else "") + ") [counted]")
        for p in w["parts"]:
            add(f"  {p['name']:<15} {p['params']:>16,} params {_size(p['bytes_per_gpu']):>28} per GPU")
    add("")
    add("KV pools:")
    add(f"  {'pool':<16} {'layers':>6} {'window':>7} {'groups':>6} {'B/token':>10} {'B/token/GPU':>12} "
        f"{'B/block':>12} {'blocks at cap':>13}")
    for p in r.pools:
        add(f"  {p.id:<16} {_d(p.layers):>6} {_d(p.sliding_window):>7} {_d(p.layer_groups):>6} {_d(p.bytes_per_token):>10} "
            f"{_d(p.bytes_per_token_per_gpu):>12} {_d(p.block_bytes):>12} {_d(p.blocks_per_request_at_cap):>13}")
    if len(r.groups) > 1:
        add("")
        add("KV-cache groups (one block pool: a block belongs to one group at a time):")
        add(f"  {'group':>5} {'pool':<16} {'layers':<40} {'B':>6} {'page B/GPU':>12} {'padding':>9} {'blocks at cap':>13}")
        for g in r.groups:
            add(f"  {g.index:>5} {g.pool:<16} {_layers(g.layers, g.padding_layers):<40} {g.block_size:>6,} "
                f"{g.page_bytes_per_gpu:>12,} {g.page_padding_bytes_per_gpu:>9,} {g.blocks_per_request_at_cap:>13,}")
    add("")
    others = " + other_engines" if any(t.category == "other_engines" for t in r.terms) else ""
    add(f"budget per GPU (weights + workspace + runtime_buffers + reserve{others} + kv_pool <= total):")
    for t in r.terms:
        add(f"  {t.category:<16} {_size(t.bytes):>32}  [{t.source}]")
    for u in r.unknown_terms:
        add(f"  {u:<16} {'not given':>32}")
    if dev.get("memory_bytes") is not None:
        add(f"  {'total':<16} {_size(dev['memory_bytes']):>32}")
    add("")
    kv = r.kv
    basis = kv.get("basis")
    tag = " (estimate: rests on an estimated term, not a hard cap)" if basis == "estimate" else ""
    if kv.get("pool_bytes_per_gpu") is not None:
        label = "KV pool left" if kv.get("pool_source") == "derived" else "KV pool"
        add(f"{label}: {_size(kv['pool_bytes_per_gpu'])} per GPU [{kv.get('pool_source')}]{tag}")
    if kv.get("num_blocks") is not None:
        add(f"  blocks: {kv['num_blocks']:,} of {_size(kv['block_bytes_per_gpu'])} per GPU "
            f"({kv['layer_groups']} layer group(s) of {kv['layer_group_size']} layers), "
            f"{kv['usable_blocks']:,} usable (null block excluded)")
    elif kv.get("usable_blocks") is not None:
        add(f"  blocks: {kv['usable_blocks']:,} usable")
    if kv.get("token_capacity") is not None:
        add(f"  token capacity: {kv['token_capacity']:,} tokens")
    if len(r.groups) > 1 and kv.get("engine_max_concurrency") is not None:
        add(f"  as vLLM sizes it: {kv['engine_token_capacity']:,} tokens, maximum concurrency "
            f"{kv['engine_max_concurrency']:.2f}x for {r.shapes['max_model_len']:,} tokens per request "
            f"({kv['engine_blocks_per_request_at_max_model_len']:,} blocks each)")
    add(f"  one request at its cap: {kv['blocks_per_request_at_cap']:,} blocks")
    c = r.concurrency
    if c.get("reserve_cap") is not None:
        rc = c["reserve_cap"]
        add(f"worst-case concurrency (reserve-cap, every request at its cap): {rc['requests']:,} requests "
            f"(limited by {rc['limited_by']})" + (" [estimate]" if rc["basis"] == "estimate" else ""))
    if c.get("admitted_now") is not None:
        add(f"admitted now: {c['admitted_now']} requests; at their cap they need {c['admitted_at_cap_blocks']:,} blocks "
            f"({c['admitted_at_cap_basis']}): " + ("fits" if c["admitted_at_cap_fits"] else "DOES NOT FIT"))
    if c.get("dynamic") is not None:
        d = c["dynamic"]
        add(f"expected concurrency (dynamic, lengths {d['lengths']}): {d['requests']:,} requests "
            f"(limited by {d['limited_by']}; mean {d['mean_blocks_per_request']} blocks held per request) "
            "[estimate, not a cap]")
    elif r.origin == "model":
        add("expected concurrency (dynamic): give --length PROMPT:OUTPUT or --lengths-file FILE")
    add("")
    v = r.verdict
    state = {True: "CLOSES", False: "DOES NOT CLOSE", None: "UNDECIDED"}[v["closes"]]
    add(f"verdict: {state}: {v['message']}")
    for f in v["failures"][1:]:
        add(f"  also: {f['term']}: {f['why']}")
    for note in r.notes:
        add(f"note: {note}")
    return "\n".join(out)


def _d(v: int | None) -> str:
    return "-" if v is None else f"{v:,}"


def _layers(layers: Sequence[int], padding: int) -> str:
    """Layer indices, an arithmetic run of four or more shortened to 'a, b, .., z (n)'."""
    if len(layers) >= 4 and len({b - a for a, b in itertools.pairwise(layers)}) == 1:
        text = f"{layers[0]}, {layers[1]}, .., {layers[-1]} ({len(layers)})"
    else:
        text = ", ".join(map(str, layers))
    return text + (f" +{padding} pad" if padding else "")
