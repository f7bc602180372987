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

from harness.process import ManagedProcess, ProcessError, free_port, start_ready

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


#: how /-/ready of kvledger (and of the cache lab) begins: a simulated engine of the demo,
#: started before the daemon binds, may hold the port a test picked, and answers anything
READY_BODY = b"kvledger"
#: ports tried when the one picked is taken by the time the daemon binds it
PORT_ATTEMPTS = 3


def start_daemon(workdir: Path, args: Sequence[str], env: dict[str, str] | None = None,
                 port: int | None = None, ready_timeout: float = 30.0, listen_flag: str = "--listen") -> Daemon:
    """``python -m kvledger.cli ARGS --listen 127.0.0.1:PORT``; returns once kvledger's own
    /-/ready answers. A free port is picked unless ``port`` is given; when another process
    (or the demo's own simulated engines, which bind ephemeral ports before the daemon
    listens) took it meanwhile, the daemon exits ("cannot listen") and another is tried."""
    workdir.mkdir(parents=True, exist_ok=True)
    for attempt in range(PORT_ATTEMPTS):
        chosen = port or free_port()
        argv = [sys.executable, "-m", "kvledger.cli", *args, listen_flag, f"127.0.0.1:{chosen}"]
        try:
            proc = start_ready(argv, workdir / f"kvledger-{chosen}.log", f"http://127.0.0.1:{chosen}/-/ready", ready_timeout,
                               cwd=workdir, env=_env(env), body_prefix=READY_BODY)
        except ProcessError as exc:
            if port is not None or attempt == PORT_ATTEMPTS - 1 or "cannot listen" not in str(exc):
                raise
            continue
        return Daemon(proc, chosen)
    raise AssertionError("unreachable")


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
