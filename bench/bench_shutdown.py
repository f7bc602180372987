"""Seconds from SIGTERM to the exit of `kvledger serve` while its pollers are busy
everywhere at once (tests/hardening_input_support.py: a 15 MiB body of escaped label values
being parsed, a token file swapped for a FIFO, headers dripped a byte a second), and the
seconds `kvledger check` takes beside an engine with that body (timeout 2 s).

The stated bound is kvledger.cli.SHUTDOWN_BOUND (5 s); tests/test_hardening_input_e2e.py
asserts a generous limit on the exit, this script reports the figures: the median and the
largest of --runs SIGTERMs, each sent once every busy poller is at work (plus a random
0..1 s), and of --runs checks.

Runs the daemon from a source tree (this one by default; --root PATH measures another
checkout, e.g. `git worktree add /tmp/before main` for the code before a change; the
code before held the exit for minutes: --limit caps each wait, a run past it is reported
as "> limit").

Run: .venv/bin/python bench/bench_shutdown.py [--runs 5] [--limit 60] [--root PATH] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--limit", type=float, default=60.0, help="seconds waited for one exit before it is killed")
    p.add_argument("--root", type=Path, default=HERE.parent, help="the source tree whose daemon is measured")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    root = args.root.resolve()
    sys.path[:0] = [str(root / "tests"), str(root / "exporter"), str(root / "engine"), str(HERE.parent / "tests")]
    from hardening_input_support import busy_daemon, hostile_vllm_body, seconds_to_exit

    from harness.hostile import HostileEngine
    from harness.kvledger_daemon import _env

    exits: list[float | None] = []
    checks: list[float | None] = []
    with tempfile.TemporaryDirectory(prefix="kvledger-bench-shutdown-") as tmp:
        for run in range(args.runs):
            with busy_daemon(Path(tmp) / f"serve-{run}") as busy:
                busy.swap_in_fifo()
                deadline = time.monotonic() + 30
                while (busy.parsing.requests < 1 or busy.drip.requests < 1) and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(random.uniform(0.0, 1.0))
                exits.append(seconds_to_exit(busy.daemon.process.proc, args.limit))
            engine = HostileEngine(hostile_vllm_body())
            try:
                config = Path(tmp) / f"check-{run}.yml"
                config.write_text(f"nvml: {{enabled: false}}\nengines:\n  - {{name: e, kind: vllm, url: \"{engine.url}\", "
                                  "timeout_seconds: 2, block_bytes: 4096}\n")
                start = time.monotonic()
                try:
                    subprocess.run([sys.executable, "-m", "kvledger.cli", "check", "--config", str(config)], cwd=tmp,
                                   env=_env(None), capture_output=True, timeout=args.limit)
                    checks.append(time.monotonic() - start)
                except subprocess.TimeoutExpired:
                    checks.append(None)
            finally:
                engine.stop()

    def summary(xs: list[float | None]) -> dict[str, object]:
        done = [x for x in xs if x is not None]
        return {"runs": len(xs), "over_limit": len(xs) - len(done),
                "median_s": round(statistics.median(done), 2) if done else None,
                "max_s": round(max(done), 2) if done and len(done) == len(xs) else f"> {args.limit:g}",
                "each_s": [None if x is None else round(x, 2) for x in xs]}

    report = {"root": str(root), "sigterm_to_exit": summary(exits), "check_beside_long_parse": summary(checks)}
    print(json.dumps(report, indent=1 if args.json else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
