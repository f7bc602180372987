"""What the in-engine publication benchmarks share (bench_vllm_publish.py, bench_sglang_publish.py):
the run over simulated engine time, the reader that polls the ledger's socket, and the table.

Each benchmark brings its modelled engine, its ledger (the plugin's engine-thread half) and the
hook the engine calls each step; ``measure`` drives them and takes the thread CPU of each hook
call, each publication and each render a reader causes.
"""

from __future__ import annotations

import argparse
import http.client
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

Output = TypeVar("Output")
ACCEPT = {"columns": "application/vnd.kvledger.v1.columns+json", "rows": "application/json"}


class Ledger(Protocol):
    """What ``measure`` reads of ``EngineLedger`` / ``SchedulerLedger``."""

    throttle: Any  # its ``clock`` is replaced by engine time
    publications: int
    document: Any  # its ``render_seconds``

    def close(self) -> None: ...


def socket_path() -> str:
    """A fresh Unix socket path for the ledger to serve on."""
    return str(Path(tempfile.mkdtemp()) / "ledger.sock")


def read_socket(path: str, accept: str, timeout: float = 60) -> bytes:
    class Conn(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(path)

    conn = Conn("localhost", timeout=timeout)
    conn.request("GET", "/", headers={"Accept": accept})
    body = conn.getresponse().read()
    conn.close()
    return body


def measure(ledger: Ledger, sock: str, *, requests: int, steps: int, form: str, step_ms: float,
            advance: Callable[[int], Output], hook: Callable[[Output], object], read_timeout: float = 60) -> dict[str, float]:
    """``steps`` engine steps of ``step_ms`` each: ``advance(replace)`` moves the modelled engine
    one step (replacing ``replace`` requests, about 5 % of them a second), then ``hook`` (the
    plugin's per-step hook, timed) gets what it returned; a reader polls the socket once a second
    of engine time, as the daemon does. Medians of thread CPU; the ledger is closed at the end."""
    accept = ACCEPT[form]
    steps_per_second = 1000 / step_ms
    replace_every = max(1, round(steps_per_second / (0.05 * requests)))  # ~5 % of requests a second
    hooks: list[float] = []
    publishes: list[float] = []
    renders: list[float] = []
    clock = [0.0]  # engine time: each step takes step_ms, as the throttle sees it
    ledger.throttle.clock = lambda: clock[0]
    ledger.throttle.next_at = 0.0
    try:
        for i in range(steps):
            output = advance(1 if i % replace_every == 0 else 0)
            publications = ledger.publications
            t = time.thread_time()
            hook(output)
            cost = time.thread_time() - t
            (publishes if ledger.publications != publications else hooks).append(cost)
            if int((i + 1) / steps_per_second) != int(i / steps_per_second):  # the daemon's poll, once a second
                before = ledger.document.render_seconds
                read_socket(sock, accept, read_timeout)
                renders.append(ledger.document.render_seconds - before)
            clock[0] += step_ms / 1000
    finally:
        ledger.close()
    return {
        "hooks_us": statistics.median(hooks) * 1e6 if hooks else 0.0,
        "publish_ms": statistics.median(publishes) * 1e3 if publishes else 0.0,
        "publishes_per_step": len(publishes) / steps,
        "render_ms": statistics.median(renders) * 1e3 if renders else 0.0,
    }


def arguments(step_word: str) -> argparse.ArgumentParser:
    """The options both benchmarks take (``step_word``: "an engine", "a scheduler"); add your own."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--step-ms", type=float, default=30.0, help=f"{step_word} step's time, for the share")
    ap.add_argument("--form", default="columns,rows")
    ap.add_argument("--requests", default="1000,10000", help="running requests, comma-separated")
    return ap


def cases(args: argparse.Namespace) -> Iterator[tuple[int, str]]:
    """(requests, form) of each row, in the table's order."""
    for n in map(int, args.requests.split(",")):
        for form in args.form.split(","):
            yield n, form


def print_header(thread: str) -> None:
    print("| requests | form read | hooks / step (no publication) | publication | publications / step | render per read "
          f"| {thread}-thread cost per step | share of a step |")
    print("|---|---|---|---|---|---|---|---|")


def print_row(n: int, form: str, r: dict[str, float], step_ms: float) -> None:
    """One row: ``measure``'s result and the total per step as a share of a step."""
    per_step_ms = (r["hooks_us"] / 1000 * (1 - r["publishes_per_step"]) + r["publish_ms"] * r["publishes_per_step"]
                   + r["render_ms"] * step_ms / 1000)
    print(f"| {n:,} | {form} | {r['hooks_us']:.0f} us | {r['publish_ms']:.2f} ms | {r['publishes_per_step']:.3f} "
          f"| {r['render_ms']:.2f} ms | {per_step_ms * 1000:.0f} us | {per_step_ms / step_ms:.2%} |", flush=True)
