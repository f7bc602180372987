"""Soak: the daemon run for a long time against the demo's four simulated engines (two
kvledger/v1 ledgers, a reserve-cap one, a stock vLLM with /metrics, KV events and a
startup log), scraped over one keep-alive connection every second like Prometheus, with
the daemon's RSS sampled every 10 s. By default the engines run in this process and the
daemon is `kvledger serve` on a generated configuration, so its RSS is the daemon's
alone; ``--demo`` soaks `kvledger demo` instead (simulators in the daemon's process, whose
replay buffers fill to their bound over the first ~20 minutes). Reports the RSS slope (least squares, MB per hour) over
the second half of the run (after warm-up), the first and last RSS, the scrape latency
p50/p99 and the daemon's CPU share. A leak shows as a positive slope that does not
flatten.

Run: .venv/bin/python bench/bench_soak.py [--minutes 30] [--demo]
"""

from __future__ import annotations

import argparse
import http.client
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from bench_daemon import proc_figures  # noqa: E402

from kvledger.config.types import EngineConfig  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def slope_mb_per_hour(points: list[tuple[float, float]]) -> float:
    xs = [t for t, _ in points]
    ys = [r for _, r in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return 0.0 if den == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den * 3600


def config_yaml(engines: list[EngineConfig]) -> str:
    """A kvledger configuration for the simulated engines (NVML off: the GPUs are simulated)."""
    out = ["interval_seconds: 1", "nvml: {enabled: false}", "engines:"]
    for e in engines:
        out.append(f"  - name: {e.name}")
        out.append(f"    kind: {e.kind}")
        out.append(f'    url: "{e.url}"')
        for key, value in [*e.options, *((k, getattr(e, k)) for k in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"))]:
            if value is not None:
                out.append(f'    {key}: "{value}"' if isinstance(value, str) else f"    {key}: {value}")
        if e.gpus:
            out.append(f"    gpus: {list(e.gpus)}")
        if e.host.port is not None:
            out.append(f"    host: {{port: {e.host.port}}}")
        if e.tenants:
            out.append("    tenants:")
            out.extend(f"      - {{name: {t.name}, quota_bytes: {t.quota_bytes}}}" for t in e.tenants)
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--demo", action="store_true", help="soak `kvledger demo` (simulators in the daemon)")
    args = ap.parse_args()
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="kvledger-soak-", suffix=".log", delete=False)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "exporter"))
    demo = None
    if args.demo:
        argv = ["demo", "--listen", f"127.0.0.1:{port}"]
    else:
        from kvledger.sim.demo import start_demo

        demo = start_demo(seed=0)
        config = Path(tempfile.mkdtemp(prefix="kvledger-soak-")) / "kvledger.yml"
        config.write_text(config_yaml(demo.engine_configs))
        argv = ["serve", "--config", str(config), "--listen", f"127.0.0.1:{port}"]
    proc = subprocess.Popen([sys.executable, "-m", "kvledger.cli", *argv], stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        deadline = time.monotonic() + 60
        while True:
            try:
                conn.request("GET", "/-/ready")
                resp = conn.getresponse()
                resp.read()
                if resp.status == 200:
                    break
            except OSError:
                conn.close()
            if time.monotonic() > deadline:
                raise SystemExit(f"demo not ready; log in {log.name}")
            time.sleep(0.2)
        start = time.monotonic()
        end = start + args.minutes * 60
        rss: list[tuple[float, float]] = []
        latencies: list[float] = []
        failures = 0
        _, cpu0 = proc_figures(proc.pid)
        next_sample = start
        while time.monotonic() < end:
            t0 = time.perf_counter()
            try:
                conn.request("GET", "/metrics")
                resp = conn.getresponse()
                resp.read()
                if resp.status != 200:
                    failures += 1
            except OSError:
                failures += 1
                conn.close()
            latencies.append(time.perf_counter() - t0)
            now = time.monotonic()
            if now >= next_sample:
                rss.append((now - start, proc_figures(proc.pid)[0]))
                next_sample += 10
            time.sleep(max(0.0, 1.0 - (time.perf_counter() - t0)))
        elapsed = time.monotonic() - start
        _, cpu1 = proc_figures(proc.pid)
        second_half = [p for p in rss if p[0] >= elapsed / 2]
        lat = sorted(latencies)
        print(f"soak: {elapsed / 60:.1f} min, {len(latencies)} scrapes over one keep-alive connection, {failures} failed")
        print(f"  RSS first {rss[0][1]:.1f} MB, last {rss[-1][1]:.1f} MB, max {max(r for _, r in rss):.1f} MB")
        print(f"  RSS slope over the second half: {slope_mb_per_hour(second_half):+.2f} MB/hour "
              f"(whole run {slope_mb_per_hour(rss):+.2f} MB/hour)")
        print(f"  scrape latency p50 {lat[len(lat) // 2] * 1000:.2f} ms, p99 {lat[int(len(lat) * 0.99)] * 1000:.2f} ms")
        where = " (the demo's simulators run in the same process)" if args.demo else ""
        print(f"  daemon CPU {100 * (cpu1 - cpu0) / elapsed:.1f} % of a core{where}")
    finally:
        proc.terminate()
        proc.wait(timeout=15)
        if demo is not None:
            demo.stop()


if __name__ == "__main__":
    main()
