"""Accounting time of one snapshot with 10,000 requests and 1,000,000 blocks (budget 50 ms),
and the parse time of the kvledger/v1 document that carries them.

Accounting is the daemon's own step (``account_snapshot``: label limits, the policy, the
render check), with an empty cache each run: what a cycle costs when the document is new.

Run: .venv/bin/python bench/bench_accounting.py
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from workload import engine_facts

from kvledger.collect.accounting import AccountCache, account_snapshot
from kvledger.config.types import LimitsConfig
from kvledger.domain.block_refs import BlockRefArray
from kvledger.domain.facts import Snapshot
from kvledger.output.prometheus import check_renderable

BUDGET_MS = 50.0


def snapshot(blocks: int = 1_000_000, requests: int = 10_000) -> Snapshot:
    rng = random.Random(3)
    facts = engine_facts("engine-0", requests, blocks, 16, rng)
    counts = array("Q", (rng.choice((0, 0, 1, 1, 1, 2, 5)) for _ in range(blocks)))
    cached = bytes(rng.random() < 0.7 for _ in range(blocks))
    pool = facts.pools[0]
    pool.block_refs = BlockRefArray(array("Q", range(blocks)), counts, cached)
    pool.in_use = pool.reclaimable = pool.free = pool.references = None
    return Snapshot(engines=[facts])


def median_ms(snap: Snapshot, runs: int = 30) -> float:
    times = []
    limits = LimitsConfig()
    for _ in range(runs):
        t = time.perf_counter()
        account_snapshot(snap, {}, limits, AccountCache(), check_renderable)
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def main() -> None:
    for sharing in ("per-request", "reference-aware"):
        snap = snapshot()
        snap.sharing = sharing  # type: ignore[assignment]
        ms = median_ms(snap)
        print(f"accounting, 10,000 requests, 1,000,000 blocks, {sharing}: median {ms:.1f} ms "
              f"({ms / BUDGET_MS:.2f} of the 50 ms budget)")


if __name__ == "__main__":
    main()
