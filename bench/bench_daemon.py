"""Daemon RSS and CPU at the docs/design.md §9 load: 8 engines serving kvledger/v1 ledgers with
10,000 in-flight requests in all and 16 tenants each, polled every second, scraped every
15 s. Budgets: RSS <= 80 MB, CPU <= 2 % of a core.

Each document is pre-serialised once so the bench process's own work stays out of the
daemon's figures. Run: .venv/bin/python bench/bench_daemon.py [--seconds 60] [--block-refs]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from kvledger.integration.document_server import serve_http

sys.path.insert(0, str(Path(__file__).parent))
from bench_protocol import build

ROOT = Path(__file__).resolve().parents[1]


def proc_figures(pid: int) -> tuple[float, float]:
    """(RSS in MB, CPU seconds) of a process, from /proc."""
    rss_kb = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("VmRSS:"))
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return rss_kb / 1024, (int(fields[11]) + int(fields[12])) / ticks


def engine_document(block_refs: bool = False) -> dict:
    """One engine's kvledger/v1 document at this load: 1,250 requests, 16 tenants."""
    doc = build(requests=1250, blocks=125_000 if block_refs else 0)
    if not block_refs:
        doc["pools"][0].pop("block_refs")
        doc["pools"][0]["num_blocks"] = 125_000
        doc["pools"][0]["blocks"] = {"in_use": 100_000, "reclaimable": 10_000, "free": 15_000}
        doc["pools"][0]["references"] = 110_000
        for r in doc["requests"]:
            r.pop("block_ids")
    doc["tenants"] = [{"name": f"t{t}", "quota_bytes": 10**10} for t in range(16)]
    return doc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--block-refs", action="store_true", help="also carry 1,000,000 block refs in one engine's ledger")
    args = ap.parse_args()
    docs = []
    for _ in range(8):
        doc = engine_document(args.block_refs)
        variants = []
        for tokens in (7000, 7001):  # a busy engine's document changes at every poll
            doc["budgets"]["iteration_tokens"] = tokens
            variants.append(json.dumps(doc, separators=(",", ":")).encode())
        docs.append(variants)
    state = {"busy": True}

    def render(variants: list[bytes], turn: list[int]) -> bytes:
        if state["busy"]:
            turn[0] += 1
        return variants[turn[0] % 2]

    servers = [serve_http(lambda v=v, t=[0]: render(v, t)) for v in docs]
    cfg = Path(tempfile.mkdtemp()) / "kvledger.yml"
    engines = "\n".join(
        f"  - {{name: engine-{i}, kind: ledger, url: '{s.url}', gpus: [{i}], tenants: "
        + "[" + ", ".join(f"{{name: t{t}, quota_bytes: 10GiB}}" for t in range(16)) + "]}"
        for i, s in enumerate(servers))
    cfg.write_text(f"interval_seconds: 1.0\nnvml: {{enabled: false}}\nengines:\n{engines}\n")
    port = 19_000 + os.getpid() % 1000
    env = dict(os.environ, PYTHONPATH=str(ROOT / "exporter"))
    daemon = subprocess.Popen([sys.executable, "-m", "kvledger.cli", "serve", "--config", str(cfg), "--listen", f"127.0.0.1:{port}"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        time.sleep(5)  # warm up
        for busy in (True, False):
            state["busy"] = busy
            time.sleep(2)
            _, cpu0 = proc_figures(daemon.pid)
            t0 = time.monotonic()
            peak = 0.0
            next_scrape = t0
            while time.monotonic() - t0 < args.seconds:
                if time.monotonic() >= next_scrape:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
                    next_scrape += 15
                rss, _ = proc_figures(daemon.pid)
                peak = max(peak, rss)
                time.sleep(0.5)
            rss, cpu1 = proc_figures(daemon.pid)
            cpu_pct = (cpu1 - cpu0) / (time.monotonic() - t0) * 100
            print(f"daemon, 8 engines x 1,250 requests x 16 tenants{' + block refs' if args.block_refs else ''}, "
                  f"1 s poll, {'documents changing every poll' if busy else 'idle engines (unchanged documents)'}: "
                  f"RSS peak {peak:.0f} MB ({peak / 80:.2f} of the 80 MB budget), "
                  f"CPU {cpu_pct:.1f} % of a core ({cpu_pct / 2:.1f} x the 2 % budget)", flush=True)
    finally:
        daemon.terminate()
        daemon.wait(10)
        for s in servers:
            s.stop()


if __name__ == "__main__":
    main()
