"""Where the busy daemon's poll cycle goes: cProfile over the daemon's own cycle (issue 31).

The load of ``bench_daemon.py`` (8 engines x 1,250 requests, 16 tenants, the realistic load
of bench/realistic_load.py; every cycle each engine serves the next second's document), the
daemon built from the same configuration as ``kvledger serve`` builds it; each cycle polls
every source (HTTP fetch, decode, conversion), harvests, assembles and accounts, in the main
thread, which alone is profiled (thread CPU time: the servers' threads stay out). Printed:
the CPU ms a cycle costs against the floor's (fetch and orjson decode of the same documents,
measured side by side, cycle by cycle; the ratio is the median of the cycles' ratios), and
the profile's top entries. The daemon's code runs hot here, cycle after cycle: a figure of
this loop is lower than ``bench_daemon.py``'s, where each second starts cold.

Run: .venv/bin/python bench/profile_cycle.py [--form rows|columns] [--cycles 60] [--top 30]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).parent))
from realistic_load import Load, dumps

from kvledger.cli import _collector, settle_garbage_collector
from kvledger.collect.collector import _timed_poll
from kvledger.collect.sources.http_client import HttpClient
from kvledger.config.loader import load_config
from kvledger_engine.document_server import LedgerServer

TICKS = 60


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--form", choices=("rows", "columns"), default="rows")
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--requests", type=int, default=1250)
    ap.add_argument("--cycles", type=int, default=60)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--sort", default="tottime")
    ap.add_argument("--no-profile", action="store_true", help="time the cycles without the profiler")
    args = ap.parse_args()
    load = Load(args.requests, seed=7)
    docs: list[bytes] = []
    for _ in range(TICKS):
        load.tick()
        docs.append(dumps(load.rows_document() if args.form == "rows" else load.columns_document()))
    clock = [0]

    def render(i: int):  # type: ignore[no-untyped-def]
        def one() -> tuple[bytes, str]:
            k = (clock[0] + 7 * i) % TICKS
            return docs[k], f"{args.form[0]}{k}"
        return one

    servers = [LedgerServer(render(i), columns=render(i) if args.form == "columns" else None) for i in range(args.engines)]
    for s in servers:
        s.start()
    try:
        cfg = Path(tempfile.mkdtemp()) / "kvledger.yml"
        lines = [f"  - {{name: engine-{i}, kind: ledger, url: '{s.url}', gpus: [{i}], tenants: ["
                 + ", ".join(f"{{name: t{t}, quota_bytes: 10GiB}}" for t in range(16)) + "]}"
                 for i, s in enumerate(servers)]
        cfg.write_text("interval_seconds: 1.0\nnvml: {enabled: false}\nengines:\n" + "\n".join(lines) + "\n")
        collector = _collector(load_config(str(cfg)))
        settle_garbage_collector()  # as ``kvledger serve`` does
        accept = "application/json" if args.form == "rows" else "application/vnd.kvledger.v1.columns+json"
        floor_clients = [HttpClient(s.url, timeout=5.0, max_bytes=64 << 20, accept=accept) for s in servers]

        def cycle() -> None:
            for r in collector._runners:
                done: Future[object] = Future()
                done.set_result(_timed_poll(r))
                r.future = done  # type: ignore[assignment]
            collector._harvest()
            collector._account()

        def floor() -> None:
            for c in floor_clients:
                orjson.loads(c.get())

        for _ in range(3):  # warm: connections, caches
            clock[0] += 1
            cycle()
            floor()
        profile = cProfile.Profile(time.thread_time)
        daemon_ms: list[float] = []
        floor_ms: list[float] = []
        for _ in range(args.cycles):
            clock[0] += 1
            t = time.thread_time()
            floor()
            floor_ms.append((time.thread_time() - t) * 1000)
            t = time.thread_time()
            if args.no_profile:
                cycle()
            else:
                profile.enable()
                cycle()
                profile.disable()
            daemon_ms.append((time.thread_time() - t) * 1000)
        assert all(h.up for h in collector.latest().health), [h.reason for h in collector.latest().health]
        d, f = statistics.median(daemon_ms), statistics.median(floor_ms)
        ratio = statistics.median(a / b for a, b in zip(daemon_ms, floor_ms, strict=True))  # cycle by cycle
        print(f"{args.form}: {args.engines} engines x {args.requests:,} requests, {len(docs[0]) / 1024:.0f} KiB a document; "
              f"median CPU ms a cycle: daemon {d:.2f}, floor {f:.2f}; daemon / floor {ratio:.2f}x "
              f"({'not ' if args.no_profile else ''}profiled; thread CPU)")
        if not args.no_profile:
            pstats.Stats(profile).sort_stats(args.sort).print_stats(args.top)
    finally:
        for s in servers:
            s.stop()


if __name__ == "__main__":
    main()
