"""A child process managed by a test: started with its output in a log file, polled
until an HTTP endpoint answers, stopped (terminate, then kill) on exit."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path


class ProcessError(RuntimeError):
    """A managed process failed to start, exited early or never became ready."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it, close). Another
    process (a parallel test worker, another user's test) may take it before the server
    binds it: starters that pick it try again on another (``PORT_ATTEMPTS``, ``port_taken``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


#: ports tried by a starter whose server could not bind the free port it was given
PORT_ATTEMPTS = 3


def port_taken(exc: ProcessError) -> bool:
    """The process exited because its port was taken meanwhile (Go's and Python's wording)."""
    return "address already in use" in str(exc).lower()


def require_binary(name: str) -> str:
    """The absolute path of an executable on PATH, or ProcessError (tests fail, never skip)."""
    path = shutil.which(name)
    if path is None:
        raise ProcessError(f"{name!r} not found on PATH; install it (Debian: see .ci/run)")
    return path


class ManagedProcess:
    """One child process whose stdout and stderr go to ``log_path``."""

    def __init__(self, argv: Sequence[str], log_path: Path, cwd: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.argv = list(argv)
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            self.argv, stdout=self._log, stderr=subprocess.STDOUT, cwd=cwd,
            env={**os.environ, **(env or {})}, start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        self._log.flush()
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def wait_http_ok(self, url: str, timeout: float = 30.0, interval: float = 0.1, body_prefix: bytes | None = None) -> None:
        """Poll ``url`` until it answers 200 (with a body starting ``body_prefix`` when given:
        another server on that port, e.g. one the process itself started first, does not
        count); ProcessError (with the log tail) when the process exits first or ``timeout``
        seconds pass."""
        deadline = time.monotonic() + timeout
        last = "no attempt"
        while time.monotonic() < deadline:
            if not self.running():
                raise ProcessError(
                    f"{self.argv[0]} exited with {self.proc.returncode} before {url} was ready:\n"
                    f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200 and (body_prefix is None or resp.read(len(body_prefix)) == body_prefix):
                        return
                    last = f"HTTP {resp.status}" if resp.status != 200 else f"an answer not starting {body_prefix!r}"
            except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
                last = str(exc)
            time.sleep(interval)
        raise ProcessError(f"{url} not ready after {timeout}s ({last}):\n{self.log_tail()}")

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate (SIGTERM), then kill after ``timeout`` seconds; idempotent."""
        if self.running():
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout)
        if not self._log.closed:
            self._log.close()


def start_ready(argv: Sequence[str], log_path: Path, ready_url: str, timeout: float = 30.0,
                cwd: Path | None = None, env: dict[str, str] | None = None, body_prefix: bytes | None = None) -> ManagedProcess:
    """Start ``argv`` and return once ``ready_url`` answers 200 (see ``wait_http_ok``); stop it
    if it never does."""
    proc = ManagedProcess(argv, log_path, cwd=cwd, env=env)
    try:
        proc.wait_http_ok(ready_url, timeout=timeout, body_prefix=body_prefix)
    except BaseException:
        proc.stop()
        raise
    return proc
