"""Two source trees' readings of the same busy engines, side by side (issue 31, point 7).

A change to the reading (the typed decode, the request table, the facts) is measured in the
setting of ``bench_daemon.py``, not over warm documents in a loop: 8 engines x 1,250
requests of the realistic load, each serving the next second's document at each poll, and
each tree's reading (``bench_daemon.READER``: the tree's sources polled one after the other
in one thread, every second) running in its own process beside the others and beside the
floor that drops each document, over the same seconds. Loops over warm documents mislead here:
taking a row table's columns with ``itemgetter`` was 10 % cheaper in one and 8 % dearer
in this setting (docs/performance.md).

Printed: each reading's CPU (% of a core) and its ratio to the floor.

Run: .venv/bin/python bench/compare_readings.py --root A --root B [--form rows|columns] [--seconds 60]
(``--root`` a checkout, e.g. ``git worktree add /tmp/before main``; a name may be given
as ``NAME=PATH``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_daemon import FLOOR, READER, Engines, measure


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", action="append", required=True, help="a source tree (NAME=PATH or PATH), given once for each")
    ap.add_argument("--form", choices=("rows", "columns"), default="rows")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--requests", type=int, default=1250)
    args = ap.parse_args()
    trees: dict[str, Path] = {}
    for given in args.root:
        name, _, path = given.rpartition("=")
        trees[name or path] = Path(path).resolve()
    engines = Engines(args.engines, args.requests)
    engines.mode = args.form
    cfg = Path(tempfile.mkdtemp()) / "kvledger.yml"
    lines = [f"  - {{name: engine-{i}, kind: ledger, url: '{s.url}', gpus: [{i}], tenants: ["
             + ", ".join(f"{{name: t{t}, quota_bytes: 10GiB}}" for t in range(16)) + "]}"
             for i, s in enumerate(engines.servers)]
    cfg.write_text("interval_seconds: 1.0\nnvml: {enabled: false}\nengines:\n" + "\n".join(lines) + "\n")
    accept = "application/json" if args.form == "rows" else "application/vnd.kvledger.v1.columns+json"
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name, root in trees.items():
            env = dict(os.environ, PYTHONPATH=str(root / "exporter"))
            procs[name] = subprocess.Popen([sys.executable, "-c", READER, str(cfg)], env=env)
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "exporter"))
        procs["floor"] = subprocess.Popen([sys.executable, "-c", FLOOR, "drop", accept, *(s.url for s in engines.servers)],
                                          env=env)
        time.sleep(8)  # every process started and polling
        results = measure({name: p.pid for name, p in procs.items()}, args.seconds)
    finally:
        for p in procs.values():
            p.terminate()
            p.wait(10)
        engines.stop()
    floor = results["floor"][0]
    print(f"{args.engines} engines x {args.requests:,} requests, {args.form}, {args.seconds:g} s side by side")
    print("| reading | CPU (% of a core) | vs the floor |")
    print("|---|---|---|")
    for name, (cpu, _) in results.items():
        print(f"| {name} | {cpu:.2f} % | {cpu / floor:.2f}x |")


if __name__ == "__main__":
    main()
