"""Where a busy daemon's CPU goes: one engine's poll at the docs/design.md §9 load, by phase.

One engine of bench_daemon.py's load (1,250 requests, 16 tenants, a document that changes at
every poll), medians over repeated runs of each phase in this process:
- fetch: the ledger source's HTTP GET of the document from a local server;
- parse: orjson.loads of those bytes;
- facts: facts_from_document (the kvledger/v1 checks and conversion);
- account: the policy's engine account of those facts;
and the whole poll (LedgerSource.poll: fetch + parse + facts + configuration).

The CPU budget (2 % of a core at a 1 s poll) leaves 20 ms per second for all eight engines:
the report gives each phase x 8 as a share of it.

Run: .venv/bin/python bench/bench_poll.py [--runs 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import orjson

from kvledger.config import EngineConfig
from kvledger.integration.document_server import serve_http
from kvledger.policy import engine_account
from kvledger.protocol import facts_from_document
from kvledger.sources.ledger import LedgerSource, fetch

sys.path.insert(0, str(Path(__file__).parent))
from bench_daemon import engine_document

ENGINES = 8
BUDGET_MS_PER_SECOND = 20.0  # 2 % of a core


def median_ms(fn: Callable[[], object], runs: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=200)
    args = ap.parse_args()
    doc = engine_document()
    variants = []
    for tokens in (7000, 7001):
        doc["budgets"]["iteration_tokens"] = tokens
        variants.append(json.dumps(doc, separators=(",", ":")).encode())
    turn = [0]

    def render() -> bytes:
        turn[0] += 1
        return variants[turn[0] % 2]

    server = serve_http(render)
    try:
        cfg = EngineConfig(name="engine-0", kind="ledger", url=server.url)
        source = LedgerSource(cfg)
        body = variants[0]
        parsed = orjson.loads(body)
        facts = facts_from_document(parsed, "engine-0")
        phases = {
            "fetch": median_ms(lambda: fetch(server.url, 5.0), args.runs),
            "parse": median_ms(lambda: orjson.loads(body), args.runs),
            "facts": median_ms(lambda: facts_from_document(parsed, "engine-0"), args.runs),
            "account": median_ms(lambda: engine_account(facts, "per-request"), args.runs),
            "whole poll": median_ms(source.poll, args.runs),
        }
    finally:
        server.stop()
    print(f"one engine's poll, 1,250 requests, {len(body) / 1024:.0f} KiB document (median of {args.runs}):")
    for name, ms in phases.items():
        share = ms * ENGINES / BUDGET_MS_PER_SECOND
        print(f"  {name:<10} {ms:6.2f} ms; x {ENGINES} engines every second = {share:.2f} of the 2 % CPU budget")


if __name__ == "__main__":
    main()
