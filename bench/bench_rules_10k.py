"""Rule evaluation at fleet scale: a real Prometheus scraping 10,000 synthetic engines and
evaluating alerts/kvledger.rules.yml, every group's and every saturation rule's evaluation
time as Prometheus itself reports it (/api/v1/rules: ``evaluationTime``).

    .venv/bin/python bench/bench_rules_10k.py        # 10,000 engines, 100 targets, 4 minutes measured
    .venv/bin/python bench/bench_rules_10k.py --engines 1000 --targets 10 --seconds 15 --interval 2s   # a quick look

The synthetic fleet: ``--targets`` kvledger daemons (scrape targets) of ``engines/targets``
engines each, every target in one of ten namespaces; an engine is a deployment's replica
(``engine`` names repeat over the targets of a namespace: 1,000 deployments of 10 replicas at
the defaults). Per engine the families the saturation rules read, as the daemon exports them:
kvledger_saturation_ratio (kv_quota, kv_physical on pool 0, sequences and token_budget on the
engine), kvledger_saturation_binding (the three constraints a dynamic engine's admission
enforces), kvledger_requests{state="waiting"} (changing at every scrape) and
kvledger_admission_headroom_requests. Values are drawn once per engine; the binding is the
largest ratio. A baseline follows: one plain aggregation over the raw ratio family through the
query API (the floor of any rule reading raw series on the machine). The figures are
reported, never asserted (docs/autoscaling.md, "Cost at
10,000 engines").
"""

from __future__ import annotations

import argparse
import http.server
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "alerts" / "kvledger.rules.yml"
CONSTRAINTS = ("kv_physical", "sequences", "token_budget")  # a dynamic engine's enforced constraints


def target_body(target: int, engines: int, scrape: int, seed: int) -> bytes:
    rng = random.Random(seed * 1_000_003 + target)
    lines = []
    for j in range(engines):
        e = f"m{j}"
        ratios = {"kv_quota": rng.uniform(0.2, 1.6), "kv_physical": rng.uniform(0.05, 1.0),
                  "sequences": rng.uniform(0.0, 1.0), "token_budget": rng.uniform(0.0, 1.0)}
        for constraint, value in ratios.items():
            pool = "0" if constraint.startswith("kv_") else ""
            lines.append(f'kvledger_saturation_ratio{{engine="{e}",pool="{pool}",constraint="{constraint}",basis="exact"}} {value}')
        binding = max(CONSTRAINTS, key=lambda c: ratios[c])
        for constraint in CONSTRAINTS:
            lines.append(f'kvledger_saturation_binding{{engine="{e}",constraint="{constraint}"}} {int(constraint == binding)}')
        waiting = rng.randrange(0, 50) + (scrape if ratios[binding] > 0.9 else 0)
        lines.append(f'kvledger_requests{{engine="{e}",state="waiting"}} {waiting}')
        lines.append(f'kvledger_admission_headroom_requests{{engine="{e}",pool="0",basis="exact"}} {rng.randrange(0, 64)}')
    return ("\n".join(lines) + "\n").encode()


class Fleet:
    """One HTTP server; /t/<n> is target n's exposition (re-rendered every ``--rerender`` scrapes)."""

    def __init__(self, targets: int, engines: int, seed: int) -> None:
        self.per_target = engines // targets
        self.targets, self.seed = targets, seed
        self.scrapes = [0] * targets
        self.bodies = [target_body(t, self.per_target, 0, seed) for t in range(targets)]
        fleet = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                t = int(self.path.rsplit("/", 1)[1])
                fleet.scrapes[t] += 1
                if fleet.scrapes[t] % 4 == 0:  # the queues move
                    fleet.bodies[t] = target_body(t, fleet.per_target, fleet.scrapes[t], fleet.seed)
                body = fleet.bodies[t]
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())["data"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=10_000)
    ap.add_argument("--targets", type=int, default=100)
    ap.add_argument("--seconds", type=float, default=240.0, help="how long to measure after the warm-up")
    ap.add_argument("--interval", default="10s", help="scrape and evaluation interval")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    binary = shutil.which("prometheus")
    if binary is None:
        print("prometheus is not on PATH (Debian package prometheus)", file=sys.stderr)
        return 2
    fleet = Fleet(args.targets, args.engines, args.seed)
    work = Path(tempfile.mkdtemp(prefix="kvledger-rules-bench-"))
    prom_port = _free_port()
    config = {
        "global": {"scrape_interval": args.interval, "evaluation_interval": args.interval, "scrape_timeout": args.interval},
        "rule_files": [str(RULES)],
        "scrape_configs": [{
            "job_name": "kvledger",
            "metrics_path": "/t/0",
            "static_configs": [
                {"targets": [f"127.0.0.1:{fleet.port}"], "labels": {"namespace": f"ns-{t % 10}", "__metrics_path__": f"/t/{t}",
                                                                    "node": f"node-{t}"}}
                for t in range(args.targets)
            ],
            # one address serves every target: the instance label tells them apart, as nodes would
            "relabel_configs": [{"source_labels": ["node"], "target_label": "instance"}],
        }],
    }
    (work / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    proc = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
                            stdout=subprocess.DEVNULL, stderr=open(work / "prometheus.log", "w"))
    api = f"http://127.0.0.1:{prom_port}/api/v1"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                up = get(f"{api}/query?query=count(up%3D%3D1)")["result"]
                if up and int(float(up[0]["value"][1])) == args.targets:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"targets not up; see {work / 'prometheus.log'}")
            time.sleep(1)
        series = get(f"{api}/query?query=count(%7B__name__%3D~%22kvledger_.%2A%22%7D)")["result"][0]["value"][1]
        time.sleep(3 * _seconds(args.interval))  # warm-up: a few evaluations with every series present
        groups: dict[str, list[float]] = {}
        rules: dict[str, list[float]] = {}
        seen: dict[str, str] = {}
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            for g in get(f"{api}/rules")["groups"]:
                if seen.get(g["name"]) == g["lastEvaluation"]:
                    continue
                seen[g["name"]] = g["lastEvaluation"]
                groups.setdefault(g["name"], []).append(g["evaluationTime"])
                if g["name"] == "kvledger-saturation":
                    for r in g["rules"]:
                        rules.setdefault(r["name"], []).append(r["evaluationTime"])
            time.sleep(1)
        recorded = {name: get(f"{api}/query?query=count({urllib.request.quote(name)})")["result"] for name in rules}
        # the floor of any rule that reads a raw family: one aggregation over the raw ratios
        baseline = []
        for _ in range(7):
            began = time.perf_counter()
            get(f"{api}/query?query=" + urllib.request.quote("sum(kvledger_saturation_ratio)"))
            baseline.append(time.perf_counter() - began)
    finally:
        proc.terminate()
        proc.wait(30)
        fleet.server.shutdown()
    version = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    print(f"{version}; {args.engines} engines on {args.targets} targets, {series} kvledger series, "
          f"interval {args.interval}, {args.seconds:g} s measured")
    print(f"{'rule group':<28} {'evaluations':>11} {'median ms':>10} {'max ms':>8}")
    for name, times in sorted(groups.items()):
        print(f"{name:<28} {len(times):>11} {statistics.median(times) * 1e3:>10.2f} {max(times) * 1e3:>8.2f}")
    print(f"\n{'kvledger-saturation rule':<54} {'series':>7} {'median ms':>10} {'max ms':>8}")
    for name, times in rules.items():
        out = recorded[name]
        count = out[0]["value"][1] if len(out) == 1 else "-"
        print(f"{name:<54} {count:>7} {statistics.median(times) * 1e3:>10.2f} {max(times) * 1e3:>8.2f}")
    print(f"\nbaseline: sum(kvledger_saturation_ratio) over {args.engines * 4} raw series, through the query API: "
          f"median {statistics.median(baseline) * 1e3:.2f} ms")
    shutil.rmtree(work, ignore_errors=True)
    return 0


def _seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60}
    for suffix in ("ms", "s", "m"):
        if duration.endswith(suffix):
            return float(duration[: -len(suffix)]) * units[suffix]
    return float(duration)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    sys.exit(main())
