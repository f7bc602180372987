"""A plan from a running kvledger (``plan_from_live``): its JSON view or /metrics, whose
measured terms and configuration replace the derivations of a plan from a model.
"""

from __future__ import annotations

import json
from typing import Any

from kvledger.policy.arithmetic import ceil_div
from kvledger.tools.plan.report import PlanError, PoolReport, Report, Term, budget_verdict
from kvledger.tools.plan.sizing import (
    PLAN_TERM_ORDER,
    GroupShape,
    expected_concurrency,
    time_weighted_request_blocks,
    worst_case_concurrency,
)

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
    verdict = budget_verdict(total, terms, [u for u in unknown if u != "reserve" or total is None], 0, None, extra)
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
