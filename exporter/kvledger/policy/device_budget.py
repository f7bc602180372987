"""The device budget: the terms of each GPU's memory, what is unaccounted and the slack."""

from __future__ import annotations

from collections.abc import Iterable

from kvledger.domain.accounts import BudgetTerm, GpuAccount
from kvledger.domain.facts import (
    BUDGET_CATEGORIES,
    EngineFacts,
    GpuFacts,
    MemoryTerm,
    Snapshot,
)
from kvledger.domain.measure import Measure


def kv_pool_terms(engine: EngineFacts) -> list[MemoryTerm]:
    """The KV pool's bytes per GPU, from the pools' capacity, split evenly over the
    engine's GPUs (tensor parallelism shards every block across its ranks)."""
    if not engine.gpus:
        return []
    total = 0
    for pool in engine.pools:
        if pool.block_bytes is None:
            return []
        total += pool.num_blocks * pool.block_bytes
    if not engine.pools:
        return []
    share = total // len(engine.gpus)
    return [MemoryTerm(g, "kv_pool", share, "measured") for g in engine.gpus]


def budget_terms(engines: Iterable[EngineFacts]) -> list[BudgetTerm]:
    out: list[BudgetTerm] = []
    for engine in engines:
        declared = {(t.gpu, t.category) for t in engine.memory}
        terms = list(engine.memory) + [t for t in kv_pool_terms(engine) if (t.gpu, t.category) not in declared]
        for t in terms:
            if t.category in BUDGET_CATEGORIES:
                out.append(BudgetTerm(t.gpu, engine.name, t.category, t.source, t.bytes))
    return out


ALLOCATION_CATEGORIES = ("weights", "workspace", "runtime_buffers", "kv_pool")
REQUIRED_ALLOCATIONS = ("weights", "kv_pool")


def unaccounted_bytes(gpu: GpuFacts, terms: list[BudgetTerm], engines_on_gpu: set[str]) -> Measure | None:
    """unaccounted = NVML used - (weights + workspace + runtime_buffers + kv_pool) over the
    engines on this GPU. Absent when NVML used is unknown, no engine is on the GPU, or an
    engine lacks its weights or KV pool term; an upper bound when an engine leaves out
    workspace or runtime buffers (declared allocations are then a lower bound)."""
    if not gpu.up or gpu.used_bytes is None or not engines_on_gpu:
        return None
    declared = 0
    complete = True
    for engine in engines_on_gpu:
        mine = {t.category: t.bytes for t in terms if t.engine == engine and t.gpu == gpu.index}
        if any(c not in mine for c in REQUIRED_ALLOCATIONS):
            return None
        if any(c not in mine for c in ALLOCATION_CATEGORIES):
            complete = False
        declared += sum(mine.get(c, 0) for c in ALLOCATION_CATEGORIES)
    value = gpu.used_bytes - declared
    # Without memory v2, NVML's used includes driver-reserved memory: an upper bound too.
    if gpu.driver_reserved_bytes is None:
        complete = False
    return Measure(exact=value) if complete else Measure(upper=value)


def budget_slack(gpu: GpuFacts, terms: list[BudgetTerm]) -> int | None:
    """The device budget inequality: total - (weights + workspace + runtime_buffers +
    reserve + kv_pool) over the engines on the GPU; negative when it does not close."""
    mine = [t.bytes for t in terms if t.gpu == gpu.index]
    if not gpu.up or gpu.total_bytes is None or not mine:
        return None
    return gpu.total_bytes - sum(mine)


def gpu_accounts(snapshot: Snapshot, terms: list[BudgetTerm]) -> list[GpuAccount]:
    out = []
    for gpu in snapshot.gpus:
        process_bytes: dict[str, int] = {}
        if gpu.processes is not None:
            for engine in snapshot.engines:
                pids = set(engine.pids)
                if not pids:
                    continue
                mine = [p.used_bytes for p in gpu.processes if p.pid in pids]
                if mine and all(b is not None for b in mine):
                    process_bytes[engine.name] = sum(b for b in mine if b is not None)
        on_gpu = {e.name for e in snapshot.engines if gpu.index in e.gpus}
        out.append(GpuAccount(gpu, process_bytes, unaccounted_bytes(gpu, terms, on_gpu), budget_slack(gpu, terms)))
    return out
