"""Where the Python memory of a polling daemon goes: the collector and the renderer run in
this process against the demo's four simulated engines (which run here too), with
tracemalloc on; two snapshots (after warm-up and at the end) are compared and the
largest growths printed with their tracebacks. A leak in the daemon shows as growth
under kvledger/collector, sources/ or outputs; the simulators' own buffers (a vLLM replay
buffer bounded at 10,000 batches) show under kvledger/sim.

Run: .venv/bin/python bench/trace_memory.py [--minutes 6] [--interval 0.25]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exporter"))

from kvledger.cli import _collector
from kvledger.config.types import Config, NvmlConfig
from kvledger.output.prometheus import render_text
from kvledger.sim.demo import start_demo


def snapshot() -> tracemalloc.Snapshot:
    gc.collect()
    return tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=6.0)
    ap.add_argument("--interval", type=float, default=0.25, help="poll interval (shorter: more cycles per minute)")
    args = ap.parse_args()
    tracemalloc.start(12)
    demo = start_demo(seed=0)
    collector = _collector(Config(interval_seconds=args.interval, nvml=NvmlConfig("false"), engines=tuple(demo.engine_configs)))
    collector.start()
    start = time.monotonic()
    warm = min(90.0, args.minutes * 60 / 4)
    try:
        while time.monotonic() - start < warm:
            render_text(collector.latest())
            time.sleep(args.interval)
        first = snapshot()
        print(f"after {warm:.0f} s: traced {tracemalloc.get_traced_memory()[0] / 1e6:.1f} MB", flush=True)
        while time.monotonic() - start < args.minutes * 60:
            render_text(collector.latest())
            time.sleep(args.interval)
        last = snapshot()
        print(f"after {args.minutes * 60:.0f} s: traced {tracemalloc.get_traced_memory()[0] / 1e6:.1f} MB "
              f"({collector.cycles} accounting cycles)")
        for stat in last.compare_to(first, "traceback")[:8]:
            print(f"\n{stat.size_diff / 1e3:+.1f} kB in {stat.count_diff:+d} blocks")
            for line in stat.traceback.format()[-6:]:
                print("   ", line)
    finally:
        collector.stop()
        demo.stop()


if __name__ == "__main__":
    main()
