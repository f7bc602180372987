"""The busy daemon at the realistic load (issue 14), against the cost of merely reading its inputs.

8 engines x 1,250 requests, 16 tenants each, polled every second, scraped every 15 s (gzip,
as Prometheus asks, at a steady cadence from the daemon's start; measured after three
scrapes, as a daemon that Prometheus has scraped a while). The load is the one of a real
engine (bench/realistic_load.py): every running request's computed and generated tokens
advance 20 tokens a second, its blocks grow every block_size tokens, ~5 % of the requests
are replaced every second; each engine serves the next second's document at each poll. The documents are rendered before the run (60
seconds of them, cycled) so the bench's own work stays out of the figures.

Phases, each ``--seconds`` long; in each, the floor and the daemon run side by side and are
measured over the same seconds (this machine's speed drifts by tens of percent over minutes):
- ``floor (rows)``: a process that only fetches each engine's row-form document with the
  daemon's HTTP client and decodes it with orjson, every second, keeping each engine's latest
  document until the next replaces it: the cost of reading the inputs and holding the
  latest state, as anything serving it must; ``floor dropping each document``, beside it,
  the same dropping each document once decoded (the floor measured before: both ratios are printed);
  ``daemon (rows)``: ``kvledger serve`` against plain v1 servers (row form only);
- ``floor (columns)`` and ``daemon (columns)``: the same with servers that offer the columnar
  form (the daemon asks for it; the floor fetches it the same way);
- ``daemon (idle)``: the same servers with documents that do not change (conditional reads: 304);
- ``its reading alone``, beside each floor: the daemon's sources polled the floor's way (one
  thread, every second), each poll what a poll thread of the daemon runs: fetch, typed
  decode, the requests' columns, the facts. The daemon's cost beyond it is its collector
  (assembly, accounts, the render check), its threads and its server.

Printed: CPU as % of one core, RSS peak, and daemon / floor ratios. Budgets (docs/design.md
§9): CPU <= 2 % of a core, RSS <= 80 MB.

Run: .venv/bin/python bench/bench_daemon.py [--seconds 30] [--engines 8] [--requests 1250] [--scrape-interval 15]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from realistic_load import Load, dumps

from kvledger_engine.document_server import LedgerServer

ROOT = Path(__file__).resolve().parents[1]
TICKS = 60

#: the floor: each engine's document fetched with the daemon's HTTP client and decoded with
#: orjson, every second. ``hold`` (argv[1]): each engine's latest document is kept until the
#: next one replaces it, as anything that serves the latest state must (the daemon keeps
#: its facts for the next scrape; freeing a document a second later costs more than at
#: once, its memory no longer in the caches); ``drop``: each is dropped once decoded (the
#: floor of the stops before the last of issue 31)
FLOOR = textwrap.dedent("""
    import sys, time, orjson
    from kvledger.collect.sources.http_client import HttpClient
    hold, accept = sys.argv[1] == "hold", sys.argv[2]
    clients = [HttpClient(u, timeout=5.0, max_bytes=64 << 20, accept=accept) for u in sys.argv[3:]]
    latest = [None] * len(clients)
    next_at = time.monotonic()
    while True:
        for i, c in enumerate(clients):
            doc = orjson.loads(c.get())
            if hold:
                latest[i] = doc
            del doc
        next_at += 1.0
        time.sleep(max(0.0, next_at - time.monotonic()))
""")

#: the daemon's own reading, without the daemon: every source of the configuration polled the
#: floor's way (one thread, one after the other, every second), each poll what a poll thread
#: of ``kvledger serve`` runs (fetch, typed decode, the requests' columns, the facts); what the
#: daemon costs beyond it is its collector (assembly, accounts, the render check), its threads
#: and its server
READER = textwrap.dedent("""
    import sys, time
    from kvledger.collect.sources.registry import build_sources
    from kvledger.config.loader import load_config
    from kvledger.cli import settle_garbage_collector
    sources, _, _ = build_sources(load_config(sys.argv[1]))
    settle_garbage_collector()
    next_at = time.monotonic()
    while True:
        for s in sources:
            s.poll()
        next_at += 1.0
        time.sleep(max(0.0, next_at - time.monotonic()))
""")


def proc_figures(pid: int) -> tuple[float, float]:
    """(RSS in MB, CPU seconds) of a process, from /proc."""
    rss_kb = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("VmRSS:"))
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return rss_kb / 1024, (int(fields[11]) + int(fields[12])) / ticks


class Engines:
    """``n`` servers, each serving one second of the load at a time (its own offset in it)."""

    def __init__(self, n: int, requests: int) -> None:
        load = Load(requests, seed=7)
        self.rows: list[bytes] = []
        self.columns: list[bytes] = []
        for _ in range(TICKS):
            load.tick()
            self.rows.append(dumps(load.rows_document()))
            self.columns.append(dumps(load.columns_document()))
        self.mode = "rows"  # rows | columns | idle
        self.servers = [LedgerServer(self._render(i, "rows"), columns=self._render(i, "columns")) for i in range(n)]
        for s in self.servers:
            s.start()

    def _tick(self, i: int) -> int:
        if self.mode == "idle":
            return i
        return (int(time.monotonic()) + 7 * i) % TICKS

    def _render(self, i: int, form: str):  # type: ignore[no-untyped-def]
        def render() -> tuple[bytes, str]:
            k = self._tick(i)
            if form == "columns":
                if self.mode == "rows":  # a plain v1 server: the row form only
                    return self.rows[k], f"r{k}"
                return self.columns[k], f"c{k}"
            return self.rows[k], f"r{k}"

        return render

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


class Scraper:
    """Prometheus's part: a GET of /metrics (gzip) every ``interval`` seconds, from the
    daemon's start to its end, at a steady cadence as Prometheus keeps one per target."""

    def __init__(self, port: int, interval: float) -> None:
        self.port, self.interval = port, interval
        self.stop = threading.Event()
        self.seconds: list[float] = []  # each scrape's wall time
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self.stop.wait(max(0.0, next_at - time.monotonic())):
            req = urllib.request.Request(f"http://127.0.0.1:{self.port}/metrics", headers={"Accept-Encoding": "gzip"})
            start = time.perf_counter()
            urllib.request.urlopen(req, timeout=5).read()
            self.seconds.append(time.perf_counter() - start)
            next_at += self.interval


def measure(pids: dict[str, int], seconds: float) -> dict[str, tuple[float, float]]:
    """(CPU % of a core, RSS peak MB) of each process over the same ``seconds``."""
    cpu0 = {name: proc_figures(pid)[1] for name, pid in pids.items()}
    t0 = time.monotonic()
    peak = dict.fromkeys(pids, 0.0)
    while time.monotonic() - t0 < seconds:
        for name, pid in pids.items():
            peak[name] = max(peak[name], proc_figures(pid)[0])
        time.sleep(0.5)
    elapsed = time.monotonic() - t0
    return {name: ((proc_figures(pid)[1] - cpu0[name]) / elapsed * 100, peak[name]) for name, pid in pids.items()}


def wait_ready(port: int) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=1)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--requests", type=int, default=1250)
    ap.add_argument("--root", type=Path, default=ROOT, help="source tree whose exporter/ runs the daemon")
    ap.add_argument("--forms", default="rows,columns", help="which forms to measure (rows, columns or both)")
    ap.add_argument("--scrape-interval", type=float, default=15.0, help="seconds between two scrapes of /metrics")
    args = ap.parse_args()
    engines = Engines(args.engines, args.requests)
    print(f"{args.engines} engines x {args.requests:,} requests, 16 tenants; row form {len(engines.rows[0]) / 1024:.0f} KiB, "
          f"columnar form {len(engines.columns[0]) / 1024:.0f} KiB per document; {args.seconds:g} s per phase", flush=True)
    cfg = Path(tempfile.mkdtemp()) / "kvledger.yml"
    lines = [f"  - {{name: engine-{i}, kind: ledger, url: '{s.url}', gpus: [{i}], tenants: ["
             + ", ".join(f"{{name: t{t}, quota_bytes: 10GiB}}" for t in range(16)) + "]}"
             for i, s in enumerate(engines.servers)]
    cfg.write_text("interval_seconds: 1.0\nnvml: {enabled: false}\nengines:\n" + "\n".join(lines) + "\n")
    env = dict(os.environ, PYTHONPATH=str(args.root / "exporter"))
    results: dict[str, tuple[float, float]] = {}
    scrapes: dict[str, list[float]] = {}  # the scrapes' wall times during each busy phase
    try:
        for mode in args.forms.split(","):
            engines.mode = mode
            accept = "application/json" if mode == "rows" else "application/vnd.kvledger.v1.columns+json"
            port = 19_000 + os.getpid() % 1000
            urls = [s.url for s in engines.servers]
            floor = subprocess.Popen([sys.executable, "-c", FLOOR, "hold", accept, *urls], env=env)
            dropping = subprocess.Popen([sys.executable, "-c", FLOOR, "drop", accept, *urls], env=env)
            reader = subprocess.Popen([sys.executable, "-c", READER, str(cfg)], env=env)
            daemon = subprocess.Popen([sys.executable, "-m", "kvledger.cli", "serve", "--config", str(cfg), "--listen",
                                       f"127.0.0.1:{port}"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            scraper: Scraper | None = None
            try:
                wait_ready(port)
                scraper = Scraper(port, args.scrape_interval)
                time.sleep(2 * args.scrape_interval + 5)  # warm up: three scrapes, as a daemon Prometheus has scraped a while
                # side by side: the floor and the daemon over the same seconds, so the
                # machine's drift touches both alike
                scraper.seconds.clear()
                three = measure({"floor": floor.pid, "dropping": dropping.pid, "reader": reader.pid, "daemon": daemon.pid},
                                args.seconds)
                scrapes[mode] = list(scraper.seconds)
                results[f"floor ({mode})"] = three["floor"]
                results[f"floor dropping each document ({mode})"] = three["dropping"]
                results[f"its reading alone ({mode})"] = three["reader"]
                results[f"daemon ({mode})"] = three["daemon"]
                if mode == "columns":
                    floor.terminate()
                    dropping.terminate()
                    reader.terminate()
                    engines.mode = "idle"
                    time.sleep(3)
                    results["daemon (idle)"] = measure({"daemon": daemon.pid}, args.seconds)["daemon"]
            finally:
                if scraper is not None:
                    scraper.stop.set()
                for p in (floor, dropping, reader, daemon):
                    p.terminate()
                    p.wait(10)
    finally:
        engines.stop()
    print("| phase | CPU (% of a core) | RSS peak (MB) | vs its floor | vs the floor dropping each document |")
    print("|---|---|---|---|---|")
    for name, (cpu, rss) in results.items():
        form = "rows" if "rows" in name else "columns"
        floor = results.get(f"floor ({form})")
        dropping = results.get(f"floor dropping each document ({form})")
        ratio = "" if name.startswith("floor") or floor is None else f"{cpu / floor[0]:.2f}x"
        dropped = "" if name.startswith("floor (") or dropping is None or name.startswith("floor dropping") else f"{cpu / dropping[0]:.2f}x"
        print(f"| {name} | {cpu:.2f} % ({cpu / 2:.2f} of the 2 % budget) | {rss if rss else float('nan'):.0f} | {ratio} | {dropped} |")
    for mode, seconds in scrapes.items():
        if seconds:
            shown = ", ".join(f"{1000 * x:.1f}" for x in seconds)
            print(f"scrapes of the busy daemon ({mode}), gzip, ms: {shown}")


if __name__ == "__main__":
    main()
