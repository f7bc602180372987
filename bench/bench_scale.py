"""A fleet of engines (issue 31): the daemon's cost at 100 / 1,000 / 3,000 engines polled every 5 s.

One process serves every engine (asyncio, loopback, one port, engine ``i`` at ``/e{i}``): a
kvledger/v1 document of a busy engine (bench/realistic_load.py, ``--requests`` requests in
4 tenants) that changes every second, with an ETag (conditional reads answer 304 only when
nothing changed: at a 5 s poll, never); with ``--idle`` documents that never change (every
poll after the first answered 304: an idle fleet). ``kvledger serve`` polls them all at
``--interval``; a scraper asks /metrics every second, alternating plain and gzip.

Measured over ``--seconds`` after two cycles of warm-up, per fleet size:
- CPU (% of one core, user + system, /proc), RSS (peak, MB), threads and file descriptors
  (peak, /proc): the per-engine figures are the whole divided by the engines, so a flat
  per-engine cost reads as the same number at every size;
- scrape latency p50 / p99, plain and gzip: all scrapes, and those that came first after a
  new accounting cycle (``render``: the body is rendered then; the others are from memory);
  the body's size;
- freshness: at each scrape, the age of the oldest engine's last successful poll
  (``kvledger_source_last_success_timestamp_seconds``), p50 and max, against the interval;
- the engines down at the end (none expected).

``--in-process CYCLES``: instead, a collector in the bench's own process polls the engines
CYCLES times, a second apart, and the CPU per poll is printed (no interval to keep, so the
figure does not depend on how much CPU a loaded machine leaves the daemon).

Run with the machine's load beside it (printed): nice .venv/bin/python bench/bench_scale.py
[--engines 100,1000,3000] [--seconds 30] [--interval 5] [--requests 8] [--idle] [--in-process 3] [--root PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import http.client
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import ClassVar

sys.path.insert(0, str(Path(__file__).parent))
from realistic_load import Load, dumps

ROOT = Path(__file__).resolve().parents[1]
TICKS = 20


def raise_nofile(n: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n if hard == resource.RLIM_INFINITY else min(n, hard)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


# ---------------------------------------------------------------- the engines


class _Engine(asyncio.Protocol):
    docs: ClassVar[list[bytes]] = []
    idle = False  # documents that never change: every poll after the first is answered 304
    answered = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while b"\r\n\r\n" in self.buffer:
            head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
            line, *headers = head.split(b"\r\n")
            path = line.split(b" ")[1]
            if path == b"/count":  # the polls answered so far (the bench's own question)
                text = str(_Engine.answered).encode()
                self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(text) + text)  # type: ignore[attr-defined]
                continue
            _Engine.answered += 1
            i = int(path.rsplit(b"/e", 1)[1] or 0)
            k = 0 if self.idle else (int(time.time()) + 7 * i) % TICKS
            etag = b'"r%d"' % k
            if any(h.lower().startswith(b"if-none-match:") and h.split(b":", 1)[1].strip() == etag for h in headers):
                self.transport.write(b"HTTP/1.1 304 Not Modified\r\nETag: " + etag + b"\r\nContent-Length: 0\r\n\r\n")  # type: ignore[attr-defined]
                continue
            body = self.docs[k]
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nETag: " + etag  # type: ignore[attr-defined]
                                 + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)


def serve_engines(port_file: str, requests: int, idle: bool) -> None:
    """The engine process: writes its port to ``port_file``, serves until killed."""
    raise_nofile(65536)
    _Engine.idle = idle
    load = Load(requests, tenants=4, seed=11)
    docs = []
    for _ in range(TICKS):
        load.tick()
        docs.append(dumps(load.rows_document()))
    _Engine.docs = docs

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(_Engine, "127.0.0.1", 0, backlog=4096)
        Path(port_file).write_text(str(server.sockets[0].getsockname()[1]))
        await server.serve_forever()

    asyncio.run(main())


# ---------------------------------------------------------------- measuring


def proc(pid: int) -> dict[str, float]:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    rss = next(int(x.split()[1]) for x in status if x.startswith("VmRSS:")) / 1024
    threads = next(int(x.split()[1]) for x in status if x.startswith("Threads:"))
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return {"rss": rss, "threads": threads, "fds": len(os.listdir(f"/proc/{pid}/fd")), "cpu": cpu}


_LAST_SUCCESS = re.compile(rb'^kvledger_source_last_success_timestamp_seconds\{engine="e\d+",source="ledger"\} (\S+)$', re.M)


def answered(port: int) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/count")
        return int(conn.getresponse().read())
    finally:
        conn.close()


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run(engines: int, args: argparse.Namespace, engine_port: int, env: dict[str, str]) -> dict[str, float]:
    tmp = Path(tempfile.mkdtemp())
    cfg = tmp / "kvledger.yml"
    lines = [f"  - {{name: e{i}, kind: ledger, url: 'http://127.0.0.1:{engine_port}/e{i}'}}" for i in range(engines)]
    cfg.write_text(f"interval_seconds: {args.interval}\nnvml: {{enabled: false}}\nengines:\n" + "\n".join(lines) + "\n")
    port_probe = __import__("socket").socket()
    port_probe.bind(("127.0.0.1", 0))
    port = port_probe.getsockname()[1]
    port_probe.close()
    daemon = subprocess.Popen([sys.executable, "-m", "kvledger.cli", "serve", "--config", str(cfg), "--listen",
                               f"127.0.0.1:{port}"], env=env, stdout=subprocess.DEVNULL, stderr=open(tmp / "log", "w"))
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        deadline = time.monotonic() + 120
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
                raise RuntimeError("daemon not ready:\n" + (tmp / "log").read_text()[-2000:])
            time.sleep(0.5)
        time.sleep(2 * args.interval)  # warm up: two cycles
        peak = {"rss": 0.0, "threads": 0.0, "fds": 0.0}
        lat: dict[str, list[float]] = {"plain": [], "gzip": [], "render": []}
        ages: list[float] = []
        size = {"plain": 0, "gzip": 0}
        polls0 = answered(engine_port)
        start = proc(daemon.pid)
        t0 = time.monotonic()
        taken = None
        n = 0
        failed = 0
        while time.monotonic() - t0 < args.seconds:
            kind = "gzip" if n % 2 else "plain"
            headers = {"Accept-Encoding": "gzip"} if kind == "gzip" else {}
            t = time.perf_counter()
            try:
                conn.request("GET", "/metrics", headers=headers)
                resp = conn.getresponse()
                body = resp.read()
            except OSError:  # no answer within the client's 60 s: counted, and a new connection
                failed += 1
                conn.close()
                n += 1
                continue
            ms = (time.perf_counter() - t) * 1000
            lat[kind].append(ms)
            size[kind] = len(body)
            now_taken = resp.getheader("X-Kvledger-Accounts-Taken-At")
            if now_taken != taken:
                lat["render"].append(ms)
                taken = now_taken
            if n % 4 == 0:
                text = gzip.decompress(body) if kind == "gzip" else body
                stamps = [float(v) for v in _LAST_SUCCESS.findall(text)]
                if stamps:
                    ages.append(time.time() - min(stamps))
            for k, v in proc(daemon.pid).items():
                if k in peak:
                    peak[k] = max(peak[k], v)
            n += 1
            time.sleep(max(0.0, t0 + n * 1.0 - time.monotonic()))
        end = proc(daemon.pid)
        elapsed = time.monotonic() - t0
        polls = answered(engine_port) - polls0
        text = body if kind == "plain" else gzip.decompress(body)
        up = re.findall(rb'^kvledger_source_up\{engine="e\d+",source="ledger"\} 1', text, re.M)
        down = text.count(b'kvledger_source_up{engine="e') - len(up)
        conn.close()
        cpu = (end["cpu"] - start["cpu"]) / elapsed * 100
        return {"engines": engines, "cpu": cpu, "polls_per_s": polls / elapsed,
                "ms_per_poll": (end["cpu"] - start["cpu"]) * 1000 / max(1, polls),
                "rss": peak["rss"], "threads": peak["threads"], "fds": peak["fds"],
                "plain_p50": pct(lat["plain"], 0.5), "plain_p99": pct(lat["plain"], 0.99),
                "gzip_p50": pct(lat["gzip"], 0.5), "gzip_p99": pct(lat["gzip"], 0.99),
                "render_p50": pct(lat["render"], 0.5), "render_max": max(lat["render"], default=float("nan")),
                "size_plain": size["plain"] / 1e6, "size_gzip": size["gzip"] / 1e6,
                "age_p50": statistics.median(ages) if ages else float("nan"), "age_max": max(ages, default=float("nan")),
                "down": down, "failed": failed}
    finally:
        daemon.terminate()
        try:
            daemon.wait(15)
        except subprocess.TimeoutExpired:
            daemon.kill()


def in_process(engines: int, port: int, cycles: int) -> tuple[float, float]:
    """(CPU ms per poll, of which the collector's own thread) of ``cycles`` cycles of a
    Collector in this process polling ``engines`` engines, each cycle a second apart (the
    documents change every second): the per-engine cost whatever CPU the machine leaves
    the process, since no interval has to be kept."""
    from kvledger.collect.collector import Collector
    from kvledger.collect.sources.registry import build_sources
    from kvledger.config.loader import load_config

    cfg = Path(tempfile.mkdtemp()) / "kvledger.yml"
    lines = [f"  - {{name: e{i}, kind: ledger, url: 'http://127.0.0.1:{port}/e{i}'}}" for i in range(engines)]
    cfg.write_text("interval_seconds: 5\nnvml: {enabled: false}\nengines:\n" + "\n".join(lines) + "\n")
    sources, timeouts, base = build_sources(load_config(str(cfg)))
    c = Collector(sources, base_engines=base, timeouts={k: 30.0 for k in timeouts}, interval=5)
    try:
        c.poll_once()
        total = main = 0.0
        for _ in range(cycles):
            time.sleep(1.05)
            t, m = time.process_time(), time.thread_time()
            c.poll_once()
            total += time.process_time() - t
            main += time.thread_time() - m
        return total / cycles / engines * 1000, main / cycles / engines * 1000
    finally:
        c.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", default="100,1000,3000")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--interval", type=float, default=5.0)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--root", type=Path, default=ROOT, help="source tree whose exporter/ runs the daemon")
    ap.add_argument("--idle", action="store_true", help="documents that never change (answered 304)")
    ap.add_argument("--in-process", type=int, metavar="CYCLES", help="CPU per poll of a collector in this process "
                    "(no daemon, no interval to keep: the per-engine cost whatever the machine's load)")
    ap.add_argument("--serve-engines", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_engines:
        serve_engines(args.serve_engines, args.requests, args.idle)
        return
    raise_nofile(65536)
    env = dict(os.environ, PYTHONPATH=str(args.root / "exporter"))
    port_file = Path(tempfile.mkdtemp()) / "port"
    server = subprocess.Popen([sys.executable, __file__, "--serve-engines", str(port_file), "--requests", str(args.requests),
                               *(["--idle"] if args.idle else [])])
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text():
            if time.monotonic() > deadline:
                raise RuntimeError("the engine process did not start")
            time.sleep(0.1)
        engine_port = int(port_file.read_text())
        print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} / {os.getloadavg()[1]:.2f} "
              f"(1 / 5 min) at start; interval {args.interval:g} s, {args.seconds:g} s measured per size; "
              f"{args.requests} requests per engine, documents {'unchanged (304)' if args.idle else 'changing every second'}",
              flush=True)
        if args.in_process:
            sys.path.insert(0, str(args.root / "exporter"))
            print("| engines | CPU ms per poll | of which the collector thread (assembly, accounting) | load avg |")
            print("|---|---|---|---|")
            for n in (int(x) for x in args.engines.split(",")):
                per_poll, collector = in_process(n, engine_port, args.in_process)
                print(f"| {n:,} | {per_poll:.2f} | {collector:.2f} | {os.getloadavg()[0]:.2f} |", flush=True)
            return
        rows = []
        for n in (int(x) for x in args.engines.split(",")):
            r = run(n, args, engine_port, env)
            r["load"] = os.getloadavg()[0]
            rows.append(r)
            print(f"  {n} engines done (load average {r['load']:.2f})", flush=True)
    finally:
        server.terminate()
        server.wait(10)
    print("| engines | CPU % of a core | polls/s (of n/interval) | CPU ms per poll (1,000 engines / 5 s at that cost) | "
          "RSS MB (per engine, KB) | threads | fds | "
          "scrape p50 / p99 ms, plain | gzip | first after a cycle p50 / max | body MB plain / gzip | "
          "freshness p50 / max s | down | scrapes failed | load avg |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        n = r["engines"]
        print(f"| {n:,} | {r['cpu']:.1f} | {r['polls_per_s']:.0f} ({n / args.interval:.0f}) | "
              f"{r['ms_per_poll']:.2f} ({r['ms_per_poll'] * 1000 / args.interval / 10:.0f} % of a core) | "
              f"{r['rss']:.0f} ({r['rss'] * 1024 / n:.0f}) | "
              f"{r['threads']:.0f} | {r['fds']:.0f} | {r['plain_p50']:.1f} / {r['plain_p99']:.1f} | "
              f"{r['gzip_p50']:.1f} / {r['gzip_p99']:.1f} | {r['render_p50']:.0f} / {r['render_max']:.0f} | "
              f"{r['size_plain']:.2f} / {r['size_gzip']:.2f} | {r['age_p50']:.1f} / {r['age_max']:.1f} | {r['down']} | {r['failed']} | "
              f"{r['load']:.2f} |")


if __name__ == "__main__":
    main()
