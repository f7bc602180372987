"""Synthetic facts at the docs/design.md §9 budget sizes, shared by the benchmarks."""

from __future__ import annotations

import random

from kvledger.domain.facts import (
    BlockRef,
    Budgets,
    EngineFacts,
    GpuFacts,
    GpuProcess,
    HostFacts,
    Limit,
    MemoryTerm,
    PoolFacts,
    RequestFacts,
    Snapshot,
    SourceHealth,
    TenantQuota,
)

STATES = ("running", "running", "running", "waiting", "preempted")


def engine_facts(name: str, n_requests: int, n_blocks: int, tenants: int, rng: random.Random,
                 block_refs: bool = False) -> EngineFacts:
    requests = []
    for i in range(n_requests):
        requests.append(RequestFacts(
            id=f"{name}-{i}", state=rng.choice(STATES), prompt_tokens=rng.randint(16, 4000),  # type: ignore[arg-type]
            max_output_tokens=rng.randint(16, 2000), output_bound=rng.choice(("cap", "estimate")),  # type: ignore[arg-type]
            tenant=f"tenant-{i % tenants}", blocks_held=rng.randint(0, 100), computed_tokens=rng.randint(0, 4000),
            contexts=rng.choice((1, 1, 1, 2)), speculative_slots=rng.choice((0, 0, 4))))
    refs = None
    if block_refs:
        refs = [BlockRef(b, rng.choice((0, 0, 1, 1, 1, 2, 5)), rng.random() < 0.7) for b in range(n_blocks)]
    pool = PoolFacts(id="0", block_size=16, num_blocks=n_blocks, block_bytes=2 * 2**20, block_refs=refs,
                     in_use=None if refs else n_blocks // 2, reclaimable=None if refs else n_blocks // 4,
                     free=None if refs else n_blocks - n_blocks // 2 - n_blocks // 4, references=None if refs else n_blocks)
    return EngineFacts(
        name=name, kind="ledger", source="ledger", admission="dynamic", overflow="preempt-recompute",
        budgets=Budgets(8192, 3000, 256, 8192), pools=[pool], requests=requests,
        counters={"preemptions": 3, "reservation_overflows": 1, "admission_rechecks_accepted": 1,
                  "admission_rechecks_rejected": 0, "reservation_leaks": 0},
        memory=[MemoryTerm(int(name[-1]), c, 10**9, "measured") for c in ("weights", "workspace", "runtime_buffers", "reserve")],
        host=HostFacts(1000, Limit(10**6, "hard"), 5, Limit(1024, "estimate"), 0, 0),
        tenants=[TenantQuota(f"tenant-{t}", 10**10) for t in range(tenants)], gpus=[int(name[-1])], pids=[1000 + int(name[-1])])


def scrape_snapshot(engines: int = 8, gpus: int = 8, tenants: int = 16, requests: int = 10_000,
                    blocks: int = 100_000, seed: int = 1) -> Snapshot:
    rng = random.Random(seed)
    per = requests // engines
    facts = [engine_facts(f"engine-{i}", per, blocks, tenants, rng) for i in range(engines)]
    gpu_list = [GpuFacts(g, True, f"GPU-{g}", "NVIDIA H200", False, 150 * 10**9, 100 * 10**9, 49 * 10**9, 10**9,
                         [GpuProcess(1000 + g, 90 * 10**9)]) for g in range(gpus)]
    health = [SourceHealth(f.name, "ledger", True, None, 1.0, 0.01) for f in facts]
    return Snapshot(engines=facts, gpus=gpu_list, health=health, driver_version="560.35")
