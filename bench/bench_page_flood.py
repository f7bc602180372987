"""Scrapes beside a flood of pages and lab runs (issue 31, finding 3).

Runs `kvledger demo` (its JSON view on) from a source tree (this one by default; --root PATH measures
another checkout, e.g. `git archive main exporter engine | tar -x -C /tmp/before`) on a
loopback port. A scraper asks /metrics on one kept-alive connection every 0.1 s (as
Prometheus does, gzip), first alone (quiet), then while ``--clients`` clients each ask, in
a loop, /lab/run.json for a large simulation (a distinct one each time: the cache does not
help them) or /ui/ledger.json and /api/v1/accounts. Reported per phase: scrape p50 / p99 /
max and the scrapes made; the flood's answers by status; the daemon's CPU.

Issue 31's bar: scrape p50 under the flood within 3x of its quiet value.

Run: nice .venv/bin/python bench/bench_page_flood.py [--clients 32] [--seconds 15] [--root PATH]
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from harness.kvledger_daemon import run_demo  # noqa: E402


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scrape_for(port: int, seconds: float) -> list[float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.perf_counter()
        conn.request("GET", "/metrics", headers={"Accept-Encoding": "gzip"})
        resp = conn.getresponse()
        resp.read()
        out.append((time.perf_counter() - t) * 1000)
        time.sleep(0.1)
    conn.close()
    return out


def flood(port: int, stop: threading.Event, statuses: Counter[str], n: int, counter: itertools.count[int]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    while not stop.is_set():
        k = next(counter)
        if n % 2 == 0:  # a distinct large run each time: capacity and working set vary
            path = f"/lab/run.json?capacity={2 + k % 250}&working_set={300 + k % 3000}&requests=4096"
        else:
            path = "/ui/ledger.json" if k % 2 else "/api/v1/accounts"
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            resp.read()
            statuses[f"{path.split('?')[0]} {resp.status}"] += 1
            if resp.getheader("Connection", "").lower() == "close":
                conn.close()
        except OSError as exc:
            statuses[f"error {type(exc).__name__}"] += 1
            conn.close()


def summary(ms: list[float]) -> str:
    ms = sorted(ms)
    return (f"p50 {statistics.median(ms):.1f} ms, p99 {ms[min(len(ms) - 1, int(0.99 * len(ms)))]:.1f} ms, "
            f"max {ms[-1]:.1f} ms ({len(ms)} scrapes)")


def run_flood(port: int, clients: int, seconds: float) -> None:
    """The flooding process: ``clients`` threads for ``seconds``; prints the answers' statuses as JSON."""
    stop = threading.Event()
    statuses: Counter[str] = Counter()
    counter = itertools.count()
    threads = [threading.Thread(target=flood, args=(port, stop, statuses, i, counter), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(60)
    print(json.dumps(statuses))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--root", type=Path, default=ROOT)
    ap.add_argument("--flood", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.flood:
        run_flood(args.flood, args.clients, args.seconds)
        return
    env = {"PYTHONPATH": str(args.root / "exporter")}
    print(f"load average {os.getloadavg()[0]:.2f} at start ({os.cpu_count()} CPUs); daemon from {args.root}", flush=True)
    with run_demo(Path(tempfile.mkdtemp()), env=env) as daemon:  # the demo serves the JSON view
        pid = daemon.process.pid
        scrape_for(daemon.port, 3)  # warm up
        c0 = cpu_seconds(pid)
        quiet = scrape_for(daemon.port, args.seconds)
        quiet_cpu = (cpu_seconds(pid) - c0) / args.seconds * 100
        # the flood runs in a process of its own: its threads would otherwise hold this
        # process' interpreter lock while the scraper waits to time its answers
        flooder = subprocess.Popen([sys.executable, __file__, "--flood", str(daemon.port), "--clients", str(args.clients),
                                    "--seconds", str(args.seconds + 2)], stdout=subprocess.PIPE, text=True)
        time.sleep(1)
        c0 = cpu_seconds(pid)
        loaded = scrape_for(daemon.port, args.seconds)
        loaded_cpu = (cpu_seconds(pid) - c0) / args.seconds * 100
        out, _ = flooder.communicate(timeout=120)
        statuses: Counter[str] = Counter(json.loads(out))
    print(f"quiet: {summary(quiet)}; daemon CPU {quiet_cpu:.0f} % of a core")
    print(f"{args.clients} clients flooding: {summary(loaded)}; daemon CPU {loaded_cpu:.0f} % of a core "
          f"(the lab's worker process not counted)")
    print(f"scrape p50 under the flood / quiet: {statistics.median(loaded) / statistics.median(quiet):.2f}x (bar: 3x)")
    print("flood answers: " + ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items())))
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
