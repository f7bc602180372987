"""Scrape cost: /metrics for 8 GPUs, 8 engines, 16 tenants, 10,000 in-flight requests.

Side by side in one run, on the same Accounts (the same series):
- ``generate_latest``: prometheus_client's renderer over the same catalogue families
  (``AccountsCollector``), the reference;
- ``render_text``: kvledger's renderer (once per new Accounts since issue 14);
- ``render_openmetrics``: the same samples in OpenMetrics (issue 22), what a scraper asking
  for OpenMetrics (Prometheus does) gets rendered once per Accounts;
- ``from memory``: a scrape between two polls (``MetricsBody``: the bytes already rendered
  and gzip-compressed), what every scrape but the first after a cycle costs.
Medians and their ratios; at two pool sizes, to show the render does not depend on blocks.

Run: .venv/bin/python bench/bench_scrape.py [--fleet: the fleet case alone]
"""

from __future__ import annotations

import gzip
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry
from workload import scrape_snapshot

from kvledger.collect.accounting import AccountCache, account_snapshot
from kvledger.config.types import LimitsConfig
from kvledger.output.prometheus import AccountsCollector, check_renderable, render_openmetrics, render_text
from kvledger.web.endpoints import MetricsBody

BUDGET_MS = 10.0


def medians(fns: dict[str, Callable[[], object]], runs: int = 200) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t) * 1000)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    if "--fleet" in sys.argv[1:]:  # the fleet case alone
        fleet()
        return
    for blocks in (10_000, 1_000_000):
        snapshot = scrape_snapshot(blocks=blocks)
        accounts = account_snapshot(snapshot, {}, LimitsConfig(), AccountCache(), check_renderable).accounts
        accounts.health = snapshot.health
        registry = CollectorRegistry(auto_describe=False)
        registry.register(AccountsCollector(lambda a=accounts: a))
        body = render_text(accounts)
        series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
        cache = MetricsBody()
        cache.get(accounts, None, True)
        m = medians({
            "generate_latest": lambda r=registry: generate_latest(r),
            "render_text": lambda a=accounts: render_text(a),
            "render_openmetrics": lambda a=accounts: render_openmetrics(a),
            "from memory": lambda a=accounts, c=cache: c.get(a, None, True),
        })
        print(f"{blocks:>9,} blocks/pool, {series:,} series: render_text {m['render_text']:.2f} ms "
              f"({m['render_text'] / BUDGET_MS:.2f} of the 10 ms budget), generate_latest {m['generate_latest']:.2f} ms, "
              f"render_text / generate_latest = {m['render_text'] / m['generate_latest']:.2f}; "
              f"render_openmetrics {m['render_openmetrics']:.2f} ms (/ render_text = {m['render_openmetrics'] / m['render_text']:.2f}); "
              f"a scrape from memory {m['from memory'] * 1000:.1f} us ({m['from memory'] / m['render_text']:.4f} of a render)")

    fleet()


def fleet(engines: int = 1000) -> None:
    """A fleet's scrape (issue 31): ``engines`` engines of 8 requests in 4 tenants (about 5 MB
    of text): the accounting of new Accounts (with the render check, which makes each changed
    engine's lines since issue 31's second stop), the first render of new Accounts whose every
    engine changed, one whose engines' accounts were kept (idle engines: their lines joined),
    and the gzip of the body; thread CPU, medians of 5."""
    snapshot = scrape_snapshot(engines=engines, gpus=8, tenants=4, requests=8 * engines, blocks=10_000)
    accounted: list[float] = []
    changed: list[float] = []
    kept: list[float] = []
    zipped: list[float] = []
    body = b""
    for _ in range(5):
        # new accounts: every engine changed
        t = time.thread_time()
        accounts = account_snapshot(snapshot, {}, LimitsConfig(), AccountCache(), check_renderable).accounts
        accounted.append((time.thread_time() - t) * 1000)
        t = time.thread_time()
        body = render_text(accounts)
        changed.append((time.thread_time() - t) * 1000)
        t = time.thread_time()
        render_text(accounts)
        kept.append((time.thread_time() - t) * 1000)
        t = time.thread_time()
        gzip.compress(body, compresslevel=1, mtime=0)
        zipped.append((time.thread_time() - t) * 1000)
    first, z = statistics.median(changed), statistics.median(zipped)
    print(f"{engines:,} engines, {len(body) / 1e6:.2f} MB of text: accounting with the render check "
          f"{statistics.median(accounted):.0f} ms; first render with every engine changed {first:.1f} ms "
          f"(a scrape: plain {first:.1f} ms, gzip {first + z:.1f} ms); with every engine's account kept "
          f"{statistics.median(kept):.1f} ms; gzip (level 1) {z:.1f} ms")


if __name__ == "__main__":
    main()
