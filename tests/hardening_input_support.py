"""The busy daemon of tests/test_hardening_input_e2e.py and bench/bench_shutdown.py:
`kvledger serve` beside a healthy engine and three that keep a poller busy at once:

- ``parsing``: vLLM text with a 15 MiB label value of mixed escapes (timeout 60 s): the
  parser used before took minutes on it, in a thread nobody could stop;
- ``fifo``: a bearer token file swapped for a FIFO once the daemon runs (``swap_in_fifo``):
  a plain ``open()`` of it blocks until a writer comes;
- ``drip``: an engine that sends its headers a byte a second (timeout 60 s).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from harness.hostile import HostileEngine
from harness.kvledger_daemon import Daemon, run_serve
from kvledger.sim.demo import demo_profiles
from kvledger.sim.engine import SimEngine
from kvledger_engine.document_server import LedgerServer, serve_http

ROOT = Path(__file__).resolve().parents[1]
VLLM_TEXT = (ROOT / "tests" / "fixtures" / "vllm" / "vllm-0.32-like.txt").read_text()
MIB = 1 << 20


def hostile_vllm_body(mib: float = 15) -> bytes:
    unit = '\\\\a\\n\\"b\\tc\\"\\"'
    value = unit * int(mib * MIB / len(unit))
    return (VLLM_TEXT + 'vllm:hostile{a="' + value + '"} 1\n').encode()


@dataclass
class Busy:
    daemon: Daemon
    token: Path
    good: LedgerServer
    parsing: HostileEngine
    drip: HostileEngine

    def swap_in_fifo(self) -> None:
        """The token file becomes a FIFO (no writer ever comes)."""
        self.token.unlink()
        os.mkfifo(self.token)

    def release_fifo(self) -> None:
        """Open the FIFO for writing, so a reader blocked in open() (the code before) returns."""
        with contextlib.suppress(OSError):
            os.close(os.open(self.token, os.O_WRONLY | os.O_NONBLOCK))

    def restore_token(self) -> None:
        self.release_fifo()
        self.token.unlink(missing_ok=True)
        self.token.write_text("token\n")


def busy_config(workdir: Path, good: LedgerServer, parsing: HostileEngine, drip: HostileEngine, token: Path) -> Path:
    config = workdir / "kvledger.yml"
    config.write_text(yaml.safe_dump({
        "interval_seconds": 0.25,
        "nvml": {"enabled": "false"},
        "engines": [
            {"name": "good", "kind": "ledger", "url": good.url, "timeout_seconds": 1},
            {"name": "fifo", "kind": "ledger", "url": good.url, "timeout_seconds": 10,
             "authorization": {"credentials_file": str(token)}},
            {"name": "parsing", "kind": "vllm", "url": parsing.url, "timeout_seconds": 60, "block_bytes": 4096},
            {"name": "drip", "kind": "ledger", "url": drip.url, "timeout_seconds": 60},
        ],
    }))
    return config


@contextlib.contextmanager
def busy_daemon(workdir: Path) -> Iterator[Busy]:
    workdir.mkdir(parents=True, exist_ok=True)
    sim = SimEngine(demo_profiles()[0], seed=3).start()
    good = serve_http(sim.document)
    parsing = HostileEngine(hostile_vllm_body())
    drip = HostileEngine(mode="slow_headers")
    token = workdir / "token"
    token.write_text("token\n")
    busy: Busy | None = None
    try:
        with run_serve(workdir, busy_config(workdir, good, parsing, drip, token)) as daemon:
            busy = Busy(daemon, token, good, parsing, drip)
            yield busy
    finally:
        if busy is not None:
            busy.release_fifo()
        for x in (parsing, drip, good, sim):
            x.stop()


def seconds_to_exit(proc: subprocess.Popen[bytes], limit: float) -> float | None:
    """SIGTERM ``proc``; the seconds until it exits, or None when it is still running after
    ``limit`` seconds (it is then killed)."""
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
        return None
    return time.monotonic() - start
