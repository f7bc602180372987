"""The HTTP server under scrapers: one keep-alive scraper against 50 concurrent ones,
keep-alive against a new connection per scrape, and the daemon holding 1,000 idle
connections (its threads, RSS, and a scrape's latency meanwhile).

Runs `kvledger demo` from a source tree (this one by default; --root /work/main
measures another checkout, e.g. the old server) on a loopback port, and stops it.
Run: .venv/bin/python bench/bench_http.py [--root PATH] [--scrapes 200]
"""

from __future__ import annotations

import argparse
import http.client
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def proc_status(pid: int) -> tuple[int, float]:
    """(threads, RSS in MB) of a process, from /proc/PID/status."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["Threads"]), int(fields["VmRSS"].split()[0]) / 1024


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def keepalive_scrapes(port: int, n: int, out: list[float]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    for _ in range(n):
        t0 = time.perf_counter()
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        resp.read()
        out.append(time.perf_counter() - t0)
        assert resp.status == 200
    conn.close()


def new_connection_scrapes(port: int, n: int, out: list[float]) -> None:
    for _ in range(n):
        t0 = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/metrics", headers={"Connection": "close"})
        resp = conn.getresponse()
        resp.read()
        conn.close()
        out.append(time.perf_counter() - t0)
        assert resp.status == 200


def concurrent(port: int, clients: int, each: int) -> list[float]:
    out: list[float] = []
    threads = [threading.Thread(target=keepalive_scrapes, args=(port, each, out)) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def hold_idle(port: int, count: int) -> list[socket.socket]:
    """``count`` connections, each having made one keep-alive request, then left idle."""
    socks = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: bench\r\n\r\n")
        socks.append(s)
    for s in socks:
        data = b""
        while b"kvledger is healthy.\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    return socks


def ms(x: float) -> str:
    return f"{x * 1000:.2f} ms"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", type=Path, default=ROOT, help="source tree whose exporter/ runs the daemon")
    ap.add_argument("--scrapes", type=int, default=200, help="sequential scrapes per measurement")
    ap.add_argument("--idle", type=int, default=1000, help="idle connections to hold")
    args = ap.parse_args()
    port = 19_500 + os.getpid() % 400
    env = dict(os.environ, PYTHONPATH=str(args.root / "exporter"))
    daemon = subprocess.Popen([sys.executable, "-m", "kvledger.cli", "demo", "--listen", f"127.0.0.1:{port}"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=args.root)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
                c.request("GET", "/-/ready")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the daemon never became ready")
            time.sleep(0.2)
        print(f"== {args.root}: kvledger demo on 127.0.0.1:{port}", flush=True)
        keepalive_scrapes(port, 20, [])  # warm up

        one: list[float] = []
        keepalive_scrapes(port, args.scrapes, one)
        many = concurrent(port, 50, max(1, args.scrapes // 10))
        print(f"1 keep-alive scraper:   p50 {ms(pct(one, 0.5))}  p99 {ms(pct(one, 0.99))}  ({len(one)} scrapes)")
        print(f"50 keep-alive scrapers: p50 {ms(pct(many, 0.5))}  p99 {ms(pct(many, 0.99))}  ({len(many)} scrapes); "
              f"p50 ratio {pct(many, 0.5) / pct(one, 0.5):.1f}x, p99 ratio {pct(many, 0.99) / pct(one, 0.99):.1f}x")

        fresh: list[float] = []
        new_connection_scrapes(port, args.scrapes, fresh)
        ka, nc = statistics.median(one), statistics.median(fresh)
        print(f"keep-alive median {ms(ka)}, new connection median {ms(nc)}: keep-alive / new = {ka / nc:.2f}")

        threads0, rss0 = proc_status(daemon.pid)
        socks = hold_idle(port, args.idle)
        time.sleep(1.0)
        threads1, rss1 = proc_status(daemon.pid)
        held: list[float] = []
        keepalive_scrapes(port, 50, held)
        alive = sum(1 for s in socks if s.fileno() >= 0)
        print(f"{len(socks)} idle connections held ({alive} open): daemon threads {threads0} -> {threads1}, "
              f"RSS {rss0:.0f} -> {rss1:.0f} MB, scrape median meanwhile {ms(statistics.median(held))} "
              f"(p99 {ms(pct(held, 0.99))})", flush=True)
        for s in socks:
            s.close()
    finally:
        daemon.terminate()
        daemon.wait(10)


if __name__ == "__main__":
    main()
