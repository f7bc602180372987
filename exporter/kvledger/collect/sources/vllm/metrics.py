"""vLLM's /metrics text turned into EngineFacts (pure: no I/O besides an optional model config).

Versions understood (V1 engine): 0.10.2 (with the deprecated ``vllm:gpu_cache_usage_perc``
and ``vllm:gpu_prefix_cache_*`` duplicates), 0.11 (``gpu_*`` hidden), 0.12 (``gpu_*``
removed) and current releases (0.32-like: many more series and ``cache_config_info``
labels, all ignored unless listed below). Unknown series are ignored; a missing required
series (``vllm:cache_config_info`` or the KV usage gauge) raises ``SourceError("missing")``.

Data parallelism: every ``vllm:*`` series carries ``engine`` = the DP rank; each rank is
one pool whose id is that rank. ``cache_config_info``'s ``num_gpu_blocks`` is the SUM over
the DP engines: it is divided by the number of ranks seen (equal-sized ranks assumed).

Several API servers (``--api-server-count > 1``, 0.10.2/0.11): gauges appear once per
API-server process with a ``pid`` label and only one process receives the engine's
scheduler stats; the others keep their initial zeros. Per rank, the live process is the
``pid`` whose gauges (usage + running + waiting) sum highest; ties (e.g. all zero, where
every choice gives the same numbers) go to the numerically lowest pid. Counters are
summed over all their series.

Every value read is validated (``kvledger.domain.limits``): ``cache_config_info`` labels must be
integers in range (``block_size`` 1..2**30, ``num_gpu_blocks`` at most 2**32 per rank,
``kv_cache_memory_bytes`` at most 2**53 - 1, capacity bytes and tokens at most 2**53 - 1),
gauges and counters finite, request counts whole and counters non-negative; anything else
is ``SourceError("parse")`` naming the metric with its labels, or the label; the
``engine`` label must be a data-parallel rank, 0..1023 written canonically. A KV usage
outside [0, 1] (190 of 127 blocks) is no parse error but an impossible reading: that
pool's ``in_use`` and the engine's claim are left unknown and the check
``kv_cache_usage_in_range`` is reported violated (``PoolFacts.source_violations``).

In-use blocks are derived from a ratio: ``usage x usable blocks``. vLLM computes the usage
as ``1 - free / usable`` and prints every digit, so the product is a whole number up to
float rounding; it is taken as the exact in-use count only when it lies within
``RATIO_TOLERANCE x usable`` of one (``kvledger.domain.limits``: 2**-40 of the blocks,
far above the rounding and far below any real fraction of a block). A reading that is no
whole number of blocks (0.5 of 2,047 usable blocks is 1,023.5) is not what vLLM's
arithmetic produces: the engine's claim is violated, the check ``kv_cache_usage_whole_blocks``
is reported, the claim is left unknown and the pool's in-use count becomes the bound pair
of the reading's floor and ceiling (1,023 and 1,024), never an "exact" 1,024.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from kvledger.collect.sources.base import SourceError
from kvledger.collect.sources.model_config import load_model_config
from kvledger.collect.sources.prom_text import Exposition, Sample, finite, parse_exposition, samples
from kvledger.config.types import EngineConfig
from kvledger.domain.block_bytes import ModelConfigError, ModelKvShape, kv_shape
from kvledger.domain.facts import EngineFacts, PoolFacts, RequestCounts
from kvledger.domain.limits import MAX_BLOCKS, MAX_SAFE_INT, MAX_TOKENS, RATIO_TOLERANCE

USAGE_CHECK = "kv_cache_usage_in_range"
WHOLE_BLOCKS_CHECK = "kv_cache_usage_whole_blocks"
MAX_DP_RANK = 1023  # the `engine` label: a data-parallel rank

USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # newest first
RUNNING = ("vllm:num_requests_running",)
WAITING = ("vllm:num_requests_waiting",)
PREEMPTIONS = ("vllm:num_preemptions_total",)
# tokens; 0.10.2 also has the deprecated vllm:gpu_prefix_cache_* duplicates
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
CACHE_CONFIG = "vllm:cache_config_info"
RANK_LABEL = "engine"
PID_LABEL = "pid"


def parse_python_str(value: str | None) -> Any:
    """A label written with Python's str(): "None" -> None, "True" -> True, "4.0" -> 4.0."""
    if value is None or value == "None":
        return None
    if value in ("True", "False"):
        return value == "True"
    try:
        return int(value)
    except ValueError:
        pass
    try:
        return float(value)
    except ValueError:
        return value


def _quote(raw: object) -> str:
    text = repr(raw)
    return text if len(text) <= 60 else text[:57] + "..."


def _config_int(
    info: Mapping[str, str], key: str, required: bool, minimum: int = 0, maximum: int = MAX_SAFE_INT
) -> int | None:
    """A cache_config_info label holding an integer in [minimum, maximum] ("None": unknown)."""
    raw = info.get(key)
    value = parse_python_str(raw)
    if value is None:
        if required:
            raise SourceError("missing", f"{CACHE_CONFIG} has no usable '{key}' label (got {_quote(raw)})")
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SourceError("parse", f"{CACHE_CONFIG} label '{key}' is not an integer: {_quote(raw)}")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise SourceError("parse", f"{CACHE_CONFIG} label '{key}' is not a finite integer: {_quote(raw)}")
    if not minimum <= value <= maximum:
        raise SourceError("parse", f"{CACHE_CONFIG} label '{key}' must be in [{minimum}, {maximum}], got {_quote(raw)}")
    return int(value)


def _request_blocks(info: Mapping[str, str], num_blocks: int) -> int | None:
    """Blocks one request at max_model_len takes as vLLM sized it: ``kv_cache_max_concurrency``
    is ``num_gpu_blocks`` over that (summed over a hybrid model's KV-cache groups, a window
    group counted with a whole prefill chunk in flight). None when absent or out of range.
    cache_config_info says ``sliding_window="None"`` on hybrid models: this is the one stock
    sign of their groups before the KV events name them (tiny Gemma 3: 256 / 3.657 = 70
    blocks, where one full-attention group would take 32)."""
    raw = parse_python_str(info.get("kv_cache_max_concurrency"))
    if not isinstance(raw, (int, float)) or isinstance(raw, bool) or not math.isfinite(raw) or raw <= 0:
        return None
    exact = num_blocks / raw
    nearest = round(exact)
    blocks = int(nearest if abs(exact - nearest) <= 1e-6 * max(1.0, exact) else math.ceil(exact))
    return blocks if 1 <= blocks <= MAX_BLOCKS else None


def whole_blocks(blocks: float | None, capacity: int) -> int | None:
    """``blocks`` (a count derived from a ratio) as a whole number of blocks when it lies within
    ``RATIO_TOLERANCE x capacity`` of one (float rounding); None when it is no whole number."""
    if blocks is None:
        return None
    nearest = round(blocks)
    return nearest if abs(blocks - nearest) <= RATIO_TOLERANCE * max(1, capacity) else None


def _series(name: str, s: Sample) -> str:
    labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
    text = f"{name}{{{labels}}}"
    return text if len(text) <= 160 else text[:157] + "..."


def _validate_values(exp: Exposition) -> None:
    """Every value this module reads: finite; request counts whole and >= 0; counters >= 0;
    all at most 2**53 - 1. SourceError("parse") names the metric and its labels."""
    for name in (CACHE_CONFIG, next((n for n in USAGE if n in exp), CACHE_CONFIG)):
        for s in exp.get(name, []):
            rank = s.labels.get(RANK_LABEL)
            n = None if rank is None else _small_int(rank, 4)
            if rank is not None and (n is None or n > MAX_DP_RANK or str(n) != rank):
                raise SourceError(
                    "parse", f"{_series(name, s)}: label {RANK_LABEL}={_quote(rank)} is not a data-parallel rank (0..{MAX_DP_RANK})"
                )
    checks: list[tuple[tuple[str, ...], str]] = [
        (USAGE, "finite"),
        (RUNNING, "count"),
        (WAITING, "count"),
        (PREEMPTIONS, "counter"),
        (PREFIX_QUERIES, "counter"),
        (PREFIX_HITS, "counter"),
    ]
    for names, kind in checks:
        present = next((n for n in names if n in exp), None)
        if present is None:
            continue
        for s in exp[present]:
            v = s.value
            if not math.isfinite(v):
                problem = "is not finite"
            elif kind == "finite":
                continue
            elif v < 0:
                problem = "is negative"
            elif v > MAX_SAFE_INT:
                problem = f"exceeds {MAX_SAFE_INT}"
            elif kind == "count" and not v.is_integer():
                problem = "is not a whole number of requests"
            else:
                continue
            raise SourceError("parse", f"{_series(present, s)}: value {v!r} {problem}")


def _small_int(text: str, digits: int) -> int | None:
    """The value of a short ASCII decimal label (never int() of 5,000 digits or of '²')."""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= digits else None


def _rank_key(rank: str | None) -> tuple[int, str]:
    r = rank or "0"
    n = _small_int(r, 4)
    return (n, r) if n is not None else (1 << 30, r)


def _pid_key(pid: str | None) -> tuple[int, str]:
    p = pid or ""
    n = _small_int(p, 18)
    return (n, p) if n is not None else (1 << 62, p)


def _live_pid(exp: Exposition, rank: str) -> str | None:
    """The API-server pid whose gauges for ``rank`` are live (see module doc)."""
    totals: dict[str | None, float] = {}
    for names in (USAGE, RUNNING, WAITING):
        for s in samples(exp, *names):
            if s.labels.get(RANK_LABEL, "0") == rank:
                v = finite(s.value) or 0.0
                totals[s.labels.get(PID_LABEL)] = totals.get(s.labels.get(PID_LABEL), 0.0) + v
    if len(totals) <= 1:
        return next(iter(totals), None)
    return min(totals, key=lambda p: (-totals[p], _pid_key(p)))


def _gauge(exp: Exposition, names: tuple[str, ...], rank: str, pid: str | None) -> float | None:
    """The value of a gauge for one rank (and the live pid where several exist)."""
    chosen: list[Sample] = [s for s in samples(exp, *names) if s.labels.get(RANK_LABEL, "0") == rank]
    if len({s.labels.get(PID_LABEL) for s in chosen}) > 1:
        chosen = [s for s in chosen if s.labels.get(PID_LABEL) == pid]
    if not chosen:
        return None
    chosen.sort(key=lambda s: _pid_key(s.labels.get(PID_LABEL)))
    return finite(chosen[0].value)


def _cache_info(exp: Exposition, ranks: list[str]) -> dict[str, Mapping[str, str]]:
    """cache_config_info labels per rank (a rank without its own gets the lowest rank's)."""
    series = exp.get(CACHE_CONFIG, [])
    if not series:
        raise SourceError("missing", f"no {CACHE_CONFIG} series (is this vLLM's /metrics, with log stats on?)")
    by_rank: dict[str, Mapping[str, str]] = {}
    for s in sorted(series, key=lambda s: _pid_key(s.labels.get(PID_LABEL))):
        by_rank.setdefault(s.labels.get(RANK_LABEL, "0"), s.labels)
    fallback = by_rank[min(by_rank, key=_rank_key)]
    return {r: by_rank.get(r, fallback) for r in ranks}


def _version(exp: Exposition) -> str | None:
    """vLLM's version where an info series exposes one (vLLM does not by default)."""
    for name in sorted(exp):
        if name.startswith("vllm:") and name.endswith("_info"):
            for s in exp[name]:
                if s.labels.get("version"):
                    return s.labels["version"]
    return None


def _model_shape(cfg: EngineConfig, model_config: Mapping[str, Any] | None) -> ModelKvShape | None:
    if cfg.model is None:
        return None
    try:
        data = model_config if model_config is not None else load_model_config(cfg.model.config)
        return kv_shape(data, cfg.model.kv_dtype)
    except ModelConfigError as exc:
        raise SourceError("config", f"engine {cfg.name!r}: model.config: {exc}") from None


def vllm_facts_from_metrics(
    text: str | Exposition, cfg: EngineConfig, model_config: Mapping[str, Any] | None = None
) -> EngineFacts:
    """EngineFacts from vLLM's /metrics (text or an already parsed exposition).

    ``model_config``: the parsed config.json of ``cfg.model`` (loaded from its path when
    omitted and needed).
    """
    exp = parse_exposition(text) if isinstance(text, str) else text
    _validate_values(exp)
    usage_series = samples(exp, *USAGE)
    if not usage_series:
        raise SourceError("missing", f"no {USAGE[0]} (nor the 0.10.2 name {USAGE[1]}) series")
    # every rank vLLM sized (cache_config_info is exported for each from the start), not only
    # those with a usage gauge yet: a rank that has served no request has none, and counting
    # it out would size the others' pools too large (num_gpu_blocks is the ranks' total)
    ranks = sorted(
        {s.labels.get(RANK_LABEL, "0") for s in usage_series}
        | {s.labels.get(RANK_LABEL, "0") for s in exp.get(CACHE_CONFIG, [])},
        key=_rank_key,
    )
    infos = _cache_info(exp, ranks)
    shape = None
    model_loaded = False

    pools: list[PoolFacts] = []
    running_total: int | None = None
    waiting_total: int | None = None
    for rank in ranks:
        info = infos[rank]
        block_size = _config_int(info, "block_size", required=True, minimum=1, maximum=MAX_TOKENS)
        total_blocks = _config_int(info, "num_gpu_blocks", required=True)
        assert block_size is not None and total_blocks is not None
        per_rank = total_blocks // len(ranks)
        if per_rank < 2:
            raise SourceError("parse", f"{CACHE_CONFIG} num_gpu_blocks={total_blocks} leaves no usable block per rank")
        if per_rank > MAX_BLOCKS:
            raise SourceError("parse", f"{CACHE_CONFIG} num_gpu_blocks={total_blocks} exceeds {MAX_BLOCKS} blocks per rank")
        usable = per_rank - 1  # block 0 is vLLM's permanent null block
        if usable * block_size > MAX_SAFE_INT:
            raise SourceError(
                "parse", f"{CACHE_CONFIG} num_gpu_blocks x block_size = {usable} x {block_size} exceeds {MAX_SAFE_INT}"
            )

        kv_bytes = _config_int(info, "kv_cache_memory_bytes", required=False)
        tp = cfg.model.tensor_parallel if cfg.model is not None else 1
        block_bytes: int | None
        if kv_bytes:
            block_bytes = kv_bytes // per_rank * tp
        elif cfg.block_bytes is not None:
            block_bytes = cfg.block_bytes
        else:
            if not model_loaded:
                shape, model_loaded = _model_shape(cfg, model_config), True
            block_bytes = shape.block_bytes(block_size, tp) if shape is not None else None
        if block_bytes is not None and not 1 <= block_bytes <= MAX_SAFE_INT // usable:
            raise SourceError(
                "parse",
                f"engine {cfg.name!r}: {block_bytes} bytes per block over {usable} blocks is not a capacity in "
                f"[1, {MAX_SAFE_INT}] bytes (kv_cache_memory_bytes={_quote(info.get('kv_cache_memory_bytes'))})",
            )

        window = _config_int(info, "sliding_window", required=False, maximum=MAX_TOKENS)
        if window is None:
            if not model_loaded:
                shape, model_loaded = _model_shape(cfg, model_config), True
            window = shape.sliding_window if shape is not None else None
            if window is not None and not 0 <= window <= MAX_TOKENS:
                raise SourceError("config", f"engine {cfg.name!r}: model sliding window {window} is not in [0, {MAX_TOKENS}]")

        request_blocks = _request_blocks(info, per_rank)

        pid = _live_pid(exp, rank)
        usage = _gauge(exp, USAGE, rank, pid)
        violations: tuple[str, ...] = ()
        if usage is not None and not 0.0 <= usage <= 1.0:
            usage, violations = None, (USAGE_CHECK,)  # 190 of 127 blocks: impossible, not exported
        claim = usage * usable if usage is not None else None
        in_use = whole_blocks(claim, usable)
        in_use_bounds = None
        if claim is not None and in_use is None:
            # 1,023.5 blocks: no exact count; in use lies between the reading's floor and ceiling
            in_use_bounds = (math.floor(claim), math.ceil(claim))
            claim, violations = None, (WHOLE_BLOCKS_CHECK,)
        running = _gauge(exp, RUNNING, rank, pid)
        waiting = _gauge(exp, WAITING, rank, pid)
        if running is not None:
            running_total = (running_total or 0) + int(running)
        if waiting is not None:
            waiting_total = (waiting_total or 0) + int(waiting)
        pools.append(
            PoolFacts(
                id=rank,
                block_size=block_size,
                num_blocks=usable,
                block_bytes=block_bytes,
                sliding_window=window or None,
                in_use=in_use,
                in_use_bounds=in_use_bounds,
                engine_reported_used_blocks=claim,
                running_requests=int(running) if running is not None else None,
                source_violations=violations,
                engine_request_blocks=request_blocks,
            )
        )

    counters: dict[str, float] = {}
    preempt = samples(exp, *PREEMPTIONS)
    if preempt:
        counters["preemptions"] = sum(finite(s.value) or 0.0 for s in preempt)
    for counter, names in (("prefix_cache_queried_tokens", PREFIX_QUERIES), ("prefix_cache_hit_tokens", PREFIX_HITS)):
        found = samples(exp, *names)
        if found:
            counters[counter] = sum(finite(s.value) or 0.0 for s in found)

    return EngineFacts(
        name=cfg.name,
        kind="vllm",
        source="vllm",
        version=_version(exp),
        # admission, overflow, budgets, GPUs and tenants are not in /metrics: the configured
        # values and the kind's defaults are merged in by facts_merge
        pools=pools,
        request_counts=RequestCounts(running=running_total, waiting=waiting_total, preempted=None),
        counters=counters,
    )
