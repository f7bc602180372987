"""Scrapes under attack: a real Prometheus and a timed scraper (right password) against
`kvledger demo` with basic auth, while (1) N clients send wrong passwords, (2) 10,100
idle connections are held open.

Runs the daemon from a source tree (this one by default; --root PATH measures another
checkout, e.g. `git archive HEAD exporter engine | tar -x -C /tmp/before` for the code
before a change) on a loopback port, and stops everything it started.

Run: .venv/bin/python bench/bench_web_hardening.py [--root PATH] [--daemon serve|demo] [--clients 16,64]
     [--mode fixed,random] [--seconds 15] [--idle 10100] [--skip-idle] [--skip-flood]

Reports, per phase: the timed scraper's scrapes (a kept-alive connection, one every 0.1 s;
p50/p99/max latency and failures) and Prometheus' own view over the phase
(min of `up`, max and mean of `scrape_duration_seconds`, 1 s interval and 1 s timeout).
For the idle phase: the sockets are opened 256 at a time, each batch connected before
the next (a burst of 10,100 SYNs would overflow the kernel's listen queue); reported are
new-connection scrapes (every 0.2 s, 5 s timeout) and Prometheus while they are opened,
the seconds from the last one open to the first successful scrape on a new connection
(1 s timeout per try), then new-connection scrapes and Prometheus with all of them open.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from web_hardening_support import Flood, Scraper, auth_daemon, close_all, first_scrape_after, open_idle, scrape_job  # noqa: E402

from harness.prometheus import PrometheusServer, prometheus_config, start_prometheus_with_config  # noqa: E402


def prom_phase(prom: PrometheusServer, seconds: float, at: float | None = None) -> dict[str, Any]:
    """Prometheus' view of the ``seconds`` before ``at`` (now by default)."""
    window = f"{max(1, round(seconds))}s"
    def value(expr: str) -> float | None:
        result = prom.query(expr, at=at)
        return float(result[0]["value"][1]) if result else None
    up_min = value(f'min_over_time(up{{job="kvledger"}}[{window}])')
    dur_max = value(f'max_over_time(scrape_duration_seconds{{job="kvledger"}}[{window}])')
    dur_avg = value(f'avg_over_time(scrape_duration_seconds{{job="kvledger"}}[{window}])')
    n = value(f'count_over_time(up{{job="kvledger"}}[{window}])')
    down = value(f'count_over_time((up{{job="kvledger"}} == 0)[{window}:1s])')
    return {"prom_up_min": up_min, "prom_scrapes": n, "prom_down_samples": down,
            "prom_dur_max_ms": None if dur_max is None else round(dur_max * 1e3, 1),
            "prom_dur_avg_ms": None if dur_avg is None else round(dur_avg * 1e3, 1)}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def phase(name: str, port: int, prom: PrometheusServer, seconds: float, flood: Flood | None = None,
          pid: int | None = None) -> dict[str, Any]:
    cpu0 = cpu_seconds(pid) if pid else 0.0
    scraper = Scraper(port, seconds).start()
    if flood is not None:
        flood.start()
    time.sleep(seconds)
    scraper.stop()
    if flood is not None:
        flood.stop()
    out: dict[str, Any] = {"phase": name, **{k: round(v, 2) for k, v in scraper.summary().items()}}
    out.update(prom_phase(prom, seconds - 1))
    if pid:
        out["daemon_cpu_cores"] = round((cpu_seconds(pid) - cpu0) / seconds, 2)
    if flood is not None:
        out["flood_answers"] = dict(flood.statuses)
    print(json.dumps(out), flush=True)
    return out


def idle_phase(port: int, prom: PrometheusServer, n: int, seconds: float) -> dict[str, Any]:
    during = Scraper(port, 600, interval=0.2, keep_alive=False, timeout=5.0).start()
    t0, wall0 = time.monotonic(), time.time()
    socks = open_idle(port, n)
    opened, wall1 = time.monotonic() - t0, time.time()
    try:
        during.stop()
        first, failed_first = first_scrape_after(port, seconds)
        scraper = Scraper(port, seconds, keep_alive=False, timeout=5.0).start()
        time.sleep(seconds)
        scraper.stop()
        out: dict[str, Any] = {"phase": f"{n} idle sockets", "opened_s": round(opened, 2),
                               "while_opening": {**{k: round(v, 2) for k, v in during.summary().items()},
                                                 "failure_kinds": sorted({f for _, f in during.failures}),
                                                 **prom_phase(prom, wall1 - wall0, at=wall1)},
                               "first_scrape_s": None if first is None else round(first, 3),
                               "first_scrape_failures": failed_first[:5], "failed_before_first": len(failed_first),
                               **{k: round(v, 2) for k, v in scraper.summary().items()},
                               "failure_kinds": sorted({f for _, f in scraper.failures})}
        out.update(prom_phase(prom, time.time() - wall1))
    finally:
        during.stop()
        close_all(socks)
    print(json.dumps(out), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=ROOT, help="the source tree whose daemon runs")
    ap.add_argument("--clients", default="16,64")
    ap.add_argument("--mode", default="fixed,random")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--idle", type=int, default=10_100)
    ap.add_argument("--skip-idle", action="store_true")
    ap.add_argument("--skip-flood", action="store_true")
    ap.add_argument("--daemon", choices=("serve", "demo"), default="serve",
                    help="serve: `kvledger serve` with one simulated engine (its ledger server in this process); "
                         "demo: `kvledger demo` (nine simulated engines in the daemon's own process)")
    args = ap.parse_args()
    with (tempfile.TemporaryDirectory(prefix="kvledger-bench-") as tmp,
          auth_daemon(Path(tmp) / "daemon", args.root, mode=args.daemon) as daemon):
        port: int = daemon.port  # type: ignore[attr-defined]
        cfg = prometheus_config([])
        cfg["scrape_configs"] = [scrape_job(port)]
        prom = start_prometheus_with_config(Path(tmp) / "prom", cfg)
        try:
            time.sleep(3)
            phase("baseline", port, prom, args.seconds, pid=daemon.pid)
            if not args.skip_flood:
                for mode in args.mode.split(","):
                    for clients in (int(c) for c in args.clients.split(",")):
                        phase(f"{clients} wrong-password clients ({mode})", port, prom, args.seconds,
                              Flood(port, clients, args.seconds, mode), daemon.pid)
                        time.sleep(3)
            if not args.skip_idle:
                idle_phase(port, prom, args.idle, args.seconds)
        finally:
            prom.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
