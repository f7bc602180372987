"""The cost per byte of the worst engine text for the shared Prometheus text parser
(``kvledger.collect.sources.prom_text.parse_exposition``), against plain text of the same size.

Shapes, each a whole body of SIZE bytes:

- ``lines``: ordinary labelled samples (a vLLM-like line repeated): the everyday case;
- ``plain``: one sample whose label value is SIZE bytes of plain characters;
- ``quotes``: the same value made of ``\\"`` only (prometheus_client copied the rest of the
  value at each one: 5 s for 1 MiB);
- ``mixed``: ``\\\\``, ``\\n``, ``\\"``, an unknown escape ``\\t`` and plain characters, mixed;
- ``backslashes``: a value of ``\\\\`` pairs, closed by one quote (a run of backslashes before
  a quote was counted back from every quote);
- ``unclosed``: ``\\"`` only and no closing quote (the error path: a parse error);
- ``help``: a HELP line of SIZE bytes of ``\\"`` and quotes (comments are split on quotes);
- ``labels``: one sample with SIZE / 16 labels (``a123="x",`` ...).

Reports per shape and size: the median CPU time of --repeat parses in ms (the thread's CPU
time, not wall time: a loaded machine stretches the latter), microseconds per KiB, and
the ratio of its µs/KiB to ``plain``'s at the same size (1.0: as cheap as plain characters).
A linear parser shows flat µs/KiB across sizes for every shape.

--parser prometheus_client measures the parser used before (sizes capped by --old-max-mib,
since it is quadratic in escapes: 16 MiB of ``\\"`` would take about 20 minutes).

Run: .venv/bin/python bench/bench_parse_worst.py [--sizes 1,2,4,16] [--repeat 3] [--json]
     .venv/bin/python bench/bench_parse_worst.py --parser prometheus_client --sizes 0.25,0.5,1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exporter"))

from kvledger.collect.sources.base import SourceError
from kvledger.collect.sources.prom_text import parse_exposition

MIB = 1 << 20
LINE = 'vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0\n'


def _value_line(value: str, close: bool = True) -> str:
    return 'm{a="' + value + ('"} 1\n' if close else "} 1\n")


def _fill(unit: str, size: int) -> str:
    return (unit * (size // len(unit) + 1))[:size - size % len(unit)]


SHAPES: dict[str, Callable[[int], str]] = {
    "lines": lambda n: LINE * max(1, n // len(LINE)),
    "plain": lambda n: _value_line(_fill("a", n)),
    "quotes": lambda n: _value_line(_fill('\\"', n)),
    "mixed": lambda n: _value_line(_fill('\\\\a\\n\\"b\\tc\\"\\"', n)),
    "backslashes": lambda n: _value_line(_fill("\\\\", n)),
    "unclosed": lambda n: _value_line(_fill('\\"', n), close=False),
    "help": lambda n: "# HELP m " + _fill('\\"x"', n) + "\nm 1\n",
    "labels": lambda n: "m{" + ",".join(f'a{i}="x"' for i in range(max(1, n // 16))) + "} 1\n",
}


def _ours(text: str) -> None:
    try:
        parse_exposition(text)
    except SourceError:
        pass  # the unclosed shape: a parse error, as it should be


def _prometheus_client(text: str) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    try:
        for _ in text_string_to_metric_families(text):
            pass
    except ValueError:
        pass


def measure(parse: Callable[[str], None], text: str, repeat: int) -> float:
    """The median CPU seconds of the parsing thread (a shared, loaded machine stretches wall time)."""
    times = []
    for _ in range(repeat):
        start = time.thread_time()
        parse(text)
        times.append(time.thread_time() - start)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1,2,4,16", help="MiB, comma-separated")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--parser", choices=("kvledger", "prometheus_client"), default="kvledger")
    p.add_argument("--old-max-mib", type=float, default=1.0, help="largest size measured with --parser prometheus_client")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    parse = _ours if args.parser == "kvledger" else _prometheus_client
    sizes = [float(s) for s in args.sizes.split(",")]
    if args.parser == "prometheus_client":
        sizes = [s for s in sizes if s <= args.old_max_mib]
    rows = []
    for mib in sizes:
        size = int(mib * MIB)
        plain_us_kib = None
        for shape in ["plain", *(s for s in args.shapes.split(",") if s != "plain")]:
            text = SHAPES[shape](size)
            seconds = measure(parse, text, args.repeat)
            us_kib = seconds * 1e6 / (len(text) / 1024)
            if shape == "plain":
                plain_us_kib = us_kib
            assert plain_us_kib is not None
            rows.append({"parser": args.parser, "mib": mib, "shape": shape, "bytes": len(text),
                         "ms": round(seconds * 1e3, 1), "us_per_kib": round(us_kib, 2),
                         "ratio_to_plain": round(us_kib / plain_us_kib, 2)})
            if not args.json:
                r = rows[-1]
                print(f"{args.parser:17s} {mib:5g} MiB {shape:12s} {r['ms']:10.1f} ms {r['us_per_kib']:9.2f} us/KiB "
                      f"x{r['ratio_to_plain']:.2f} of plain", flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
