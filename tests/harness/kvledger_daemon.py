"""Start the real `kvledger` daemon (demo or serve) as a process for end-to-end tests.

    with run_demo(tmp_path, faults=["reserve-overcommit"]) as daemon:
        daemon.url          # http://127.0.0.1:PORT
        daemon.target       # "127.0.0.1:PORT", for a Prometheus scrape config
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from harness.process import ManagedProcess, free_port, start_ready

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Daemon:
    process: ManagedProcess
    port: int

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.target}"

    def stop(self) -> None:
        self.process.stop()


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "exporter"), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def start_daemon(workdir: Path, args: Sequence[str], env: dict[str, str] | None = None,
                 port: int | None = None, ready_timeout: float = 30.0) -> Daemon:
    """``python -m kvledger.cli ARGS --listen 127.0.0.1:PORT``; returns once /-/ready answers."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    argv = [sys.executable, "-m", "kvledger.cli", *args, "--listen", f"127.0.0.1:{port}"]
    proc = start_ready(argv, workdir / f"kvledger-{port}.log", f"http://127.0.0.1:{port}/-/ready", ready_timeout,
                       cwd=workdir, env=_env(env))
    return Daemon(proc, port)


@contextmanager
def run_demo(workdir: Path, faults: Sequence[str] = (), extra: Sequence[str] = (),
             env: dict[str, str] | None = None) -> Iterator[Daemon]:
    args = ["demo", *[a for f in faults for a in ("--fault", f)], *extra]
    daemon = start_daemon(workdir, args, env=env)
    try:
        yield daemon
    finally:
        daemon.stop()


@contextmanager
def run_lab(workdir: Path, extra: Sequence[str] = ()) -> Iterator[Daemon]:
    """`kvledger lab --serve`: the cache lab page alone (its /-/ready answers at once)."""
    daemon = start_daemon(workdir, ["lab", "--serve", *extra])
    try:
        yield daemon
    finally:
        daemon.stop()


@contextmanager
def run_serve(workdir: Path, config: Path, env: dict[str, str] | None = None) -> Iterator[Daemon]:
    daemon = start_daemon(workdir, ["serve", "--config", str(config)], env=env)
    try:
        yield daemon
    finally:
        daemon.stop()
