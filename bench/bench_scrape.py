"""Scrape render time: /metrics for 8 GPUs, 8 engines, 16 tenants, 10,000 in-flight requests.

Reports the median render time and its ratio to the 10 ms budget, at two pool sizes to show
the render does not depend on the number of blocks.  Run: .venv/bin/python bench/bench_scrape.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from workload import scrape_snapshot

from kvledger.policy import compute_accounts
from kvledger.prometheus_output import render_text

BUDGET_MS = 10.0


def median_render_ms(blocks: int, runs: int = 200) -> tuple[float, int]:
    accounts = compute_accounts(scrape_snapshot(blocks=blocks))
    times = []
    size = 0
    for _ in range(runs):
        t = time.perf_counter()
        size = len(render_text(accounts))
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times), size


def main() -> None:
    for blocks in (10_000, 1_000_000):
        ms, size = median_render_ms(blocks)
        print(f"scrape render, {blocks:>9,} blocks/pool: median {ms:.2f} ms ({ms / BUDGET_MS:.2f} of the 10 ms budget), {size:,} bytes")


if __name__ == "__main__":
    main()
