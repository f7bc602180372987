"""One engine's poll at the realistic load, against the cost of decoding it, as curves (issue 14).

Documents come from bench/realistic_load.py (every running request advances 20 tokens a
second, blocks grow every block_size tokens, ~5 % of requests replaced per second). Each
figure is the median CPU time of the polling thread (``time.thread_time``), measured side by
side in this run:

- ``decode``: orjson.loads of the body (the floor: the cost of reading the input);
- ``read``: what the daemon does with the body instead: decode and conversion together
  (``parse_document``: the common document decoded by type, every check of the protocol);
- ``read+account``: that and the policy's engine account: what a poll costs beyond the fetch;
- ``poll``: ``LedgerSource.poll`` over HTTP from a local server, plus the account: the fetch
  (client side only), reading and accounting, with the cheaper form negotiated when offered.

Curves: the requests an engine holds (1k, 10k, 100k) in both forms, and the share of
requests whose rows change each second (0 = an idle engine, answered 304). The CPU budget
is 2 % of a core at a 1 s poll (20 ms a second for every engine together): the report
gives, per form, the requests at which one engine alone would use it all. Last, documents
that depart from what the typed decoder takes as is (a field or key the schema does not
list, integral floats), read the checked way, and nulls for absent fields (read by type).

Run: .venv/bin/python bench/bench_poll.py [--runs 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).parent))
from realistic_load import Load, dumps

from kvledger.collect.sources.document import LedgerSource, parse_document
from kvledger.config.types import EngineConfig
from kvledger.policy.engine_accounts import engine_account
from kvledger_engine.document_server import LedgerServer

BUDGET_MS = 20.0  # 2 % of a core, every second


def thread_ms(fns: dict[str, Callable[[], object]], runs: int) -> dict[str, float]:
    """Median thread CPU ms of each function, run round-robin (side by side)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(runs):
        for name, fn in fns.items():
            t = time.thread_time()
            fn()
            times[name].append(time.thread_time() - t)
    return {k: statistics.median(v) * 1000 for k, v in times.items()}


def document_costs(requests: int, runs: int) -> dict[str, dict[str, float]]:
    load = Load(requests, seed=3)
    load.tick()
    out = {}
    for form, body in (("rows", dumps(load.rows_document())), ("columns", dumps(load.columns_document()))):
        facts = parse_document(body, "bench", "e")
        out[form] = thread_ms({
            "decode": lambda b=body: orjson.loads(b),
            "read": lambda b=body: parse_document(b, "bench", "e"),
            "read+account": lambda b=body: engine_account(parse_document(b, "bench", "e"), "per-request"),
            "account": lambda f=facts: engine_account(f, "per-request"),
        }, runs)
        out[form]["KiB"] = len(body) / 1024
    return out


def poll_costs(share: float, runs: int) -> dict[str, float]:
    """One engine of 1,250 requests polled over HTTP, ``share`` of its running requests
    decoding each second (0: nothing changes)."""
    load = Load(1250, seed=5, changing_share=share, replace_share=0.05 * share)
    bodies = []
    for _ in range(runs + 2):
        load.tick()
        bodies.append((dumps(load.rows_document()), dumps(load.columns_document())))
    out = {}
    for form in ("rows", "columns"):
        turn = [0]

        def render(turn: list[int] = turn) -> tuple[bytes, str]:
            k = turn[0] if share > 0 else 0
            return bodies[k][0], f"r{k}"

        def columns(turn: list[int] = turn) -> tuple[bytes, str]:
            k = turn[0] if share > 0 else 0
            return bodies[k][1], f"c{k}"

        server = LedgerServer(render, columns=columns if form == "columns" else None).start()
        try:
            source = LedgerSource(EngineConfig(name="e", kind="ledger", url=server.url, timeout_seconds=5.0))
            last = source.poll()
            times = []
            for k in range(1, runs + 1):
                turn[0] = k
                t = time.thread_time()
                contribution = source.poll()
                if contribution is not last:  # the collector keeps an unchanged engine's account
                    engine_account(contribution.facts, "per-request")
                last = contribution
                times.append(time.thread_time() - t)
            out[form] = statistics.median(times) * 1000
        finally:
            server.stop()
    return out


def departing_costs(requests: int, runs: int) -> dict[str, tuple[float, float]]:
    """Decode (orjson) and read of documents that depart from the common one, each side by side."""
    load = Load(requests, seed=3)
    load.tick()
    rows, columns = load.rows_document(), load.columns_document()
    bodies = {
        "rows: a request field the schema does not list": dict(rows, requests=[dict(r, priority=1) for r in rows["requests"]]),
        "rows: a top-level key the schema does not list": dict(rows, future={"x": 1}),
        "rows: integral floats (contexts 1.0)": dict(rows, requests=[dict(r, contexts=1.0) for r in rows["requests"]]),
        "rows: null for an absent field": dict(rows, requests=[dict(r, speculative_slots=None) for r in rows["requests"]]),
        "columns: a column the schema does not list": dict(columns, request_columns=dict(columns["request_columns"], note=1)),
    }
    out = {}
    for name, doc in bodies.items():
        body = dumps(doc)
        c = thread_ms({"decode": lambda b=body: orjson.loads(b), "read": lambda b=body: parse_document(b, "bench", "e")}, runs)
        out[name] = (c["decode"], c["read"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=30)
    args = ap.parse_args()
    print("## poll cost vs requests held (one engine; thread CPU ms, median; ratio to decode)")
    print("| requests | form | KiB | decode (floor) | read | read+account | read / decode | read+account / decode |")
    print("|---|---|---|---|---|---|---|---|")
    per_request: dict[str, float] = {}
    for n in (1_000, 10_000, 100_000):
        costs = document_costs(n, max(5, args.runs // (1 if n < 100_000 else 5)))
        for form, c in costs.items():
            print(f"| {n:,} | {form} | {c['KiB']:.0f} | {c['decode']:.2f} | {c['read']:.2f} | {c['read+account']:.2f} "
                  f"| {c['read'] / c['decode']:.2f}x | {c['read+account'] / c['decode']:.2f}x |", flush=True)
            per_request[form] = c["read+account"] / n
    for form, ms in per_request.items():
        print(f"{form}: {ms * 1000:.2f} us per request read and accounted: one engine alone reaches the 2 % budget "
              f"(20 ms a second, fetch aside) at about {BUDGET_MS / ms:,.0f} requests; eight engines at "
              f"{BUDGET_MS / ms / 8:,.0f} each")
    print()
    print("## poll cost vs share of requests changing per second (1,250 requests; HTTP poll + account, thread CPU ms)")
    print("| share changing | rows | columns | x 8 engines, columns, share of the 2 % budget |")
    print("|---|---|---|---|")
    for share in (0.0, 0.01, 0.1, 0.5, 1.0):
        c = poll_costs(share, args.runs)
        print(f"| {share:.0%} | {c['rows']:.2f} | {c['columns']:.2f} | {c['columns'] * 8 / BUDGET_MS:.2f} |", flush=True)
    print()
    print("## documents read the checked way (one engine; thread CPU ms, median; ratio to decode)")
    print("| requests | document | decode | read | read / decode |")
    print("|---|---|---|---|---|")
    for n in (1_000, 10_000):
        for name, (decode, read) in departing_costs(n, max(5, args.runs // (1 if n < 10_000 else 3))).items():
            print(f"| {n:,} | {name} | {decode:.2f} | {read:.2f} | {read / decode:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
