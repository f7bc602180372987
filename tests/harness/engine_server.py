"""A real engine's server (vLLM, SGLang) run by the real suites: what every engine's harness shares.

The server runs with the interpreter of the engine's own venv, as a subprocess in its own
process group (``stop()`` ends the engine's helper processes too: vLLM's engine core, SGLang's
scheduler and detokenizer), with its output in a log in a temporary work directory. A
subclass (``tests/vllm_real/server.py``, ``tests/sglang_real/server.py``) says how to run its
engine: ``command()``, ``environment()``, ``missing_env()`` and the class attributes.

Only the standard library is used here: the suites' servers never run inside the test process.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, ClassVar, Self


class EngineStartError(RuntimeError):
    """The server did not become healthy; the message ends with its log tail. Each engine's
    harness has its own subclass (``VllmStartError``, ``SglangStartError``)."""


def signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass  # the group is already gone


class EngineServer:
    """One engine server on this machine; ``start()`` returns once ``GET /health`` answers 200."""

    #: the engine's name in messages ("vLLM")
    ENGINE: ClassVar[str]
    #: what start() raises when the server does not become healthy
    START_ERROR: ClassVar[type[EngineStartError]] = EngineStartError
    #: the work directory's name prefix and the log's name in it
    WORK_PREFIX: ClassVar[str]
    LOG_NAME: ClassVar[str]
    #: the client timeout of one /health probe while the server starts
    HEALTH_PROBE_TIMEOUT: ClassVar[float] = 2.0

    def __init__(self, port: int, *, host: str, startup_timeout: float,
                 log_path: str | os.PathLike[str] | None = None, extra_env: dict[str, str] | None = None) -> None:
        self.port = port
        self.host = host
        self.startup_timeout = startup_timeout
        self.extra_env = dict(extra_env or {})  # e.g. a test-only plugin on PYTHONPATH
        self._work_dir = Path(tempfile.mkdtemp(prefix=self.WORK_PREFIX))
        self.log_path = Path(log_path) if log_path else self._work_dir / self.LOG_NAME
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None
        self.last_start_seconds: float | None = None
        self.start_history: list[float] = []  # seconds to healthy, one per start()
        atexit.register(self.close)

    # -- what a subclass says ----------------------------------------------------
    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        raise NotImplementedError

    def missing_env(self) -> str | None:
        """Why the engine cannot start here (its venv is not built), or None."""
        raise NotImplementedError

    # -- addresses ---------------------------------------------------------------
    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"{self.base_url}/metrics"

    @property
    def health_url(self) -> str:
        return f"{self.base_url}/health"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def work_dir(self) -> Path:
        return self._work_dir

    # -- lifecycle -----------------------------------------------------------------
    def start(self) -> float:
        """Start the server and wait for GET /health 200; return the seconds it took."""
        if self.running:
            raise RuntimeError(f"{self.ENGINE} server already running (pid {self.pid})")
        missing = self.missing_env()
        if missing is not None:
            raise self.START_ERROR(missing)
        log = open(self.log_path, "ab")
        log.write(f"\n==== start {time.strftime('%H:%M:%S')}: {self.command()}\n".encode())
        log.flush()
        self._log_file = log
        began = time.monotonic()
        self._proc = subprocess.Popen(
            self.command(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.environment(),
            cwd=self._work_dir,
            # its own process group (stop() ends the engine's helpers too) in the test's session:
            # with Linux's autogroup scheduling a session shares the CPU as one, so only inside
            # it does a lower priority for the engine give the test the CPU first
            process_group=0,
        )
        try:
            self._wait_healthy(began)
        except BaseException:
            self.stop()
            raise
        self.last_start_seconds = time.monotonic() - began
        self.start_history.append(self.last_start_seconds)
        return self.last_start_seconds

    def _wait_healthy(self, began: float) -> None:
        assert self._proc is not None
        deadline = began + self.startup_timeout
        while True:
            code = self._proc.poll()
            if code is not None:
                raise self.START_ERROR(f"{self.ENGINE} exited with code {code} before it was healthy\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.health_url, timeout=self.HEALTH_PROBE_TIMEOUT) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # not listening (or not ready) yet
            if time.monotonic() > deadline:
                raise self.START_ERROR(f"{self.ENGINE} not healthy after {self.startup_timeout:.0f} s\n{self.log_tail()}")
            time.sleep(0.5)  # pacing of the /health poll; the deadline only bounds a failure

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM the server's process group, SIGKILL whatever is left after ``grace``."""
        proc = self._proc
        if proc is not None:
            pgid = proc.pid  # process_group=0: the group id is the leader's pid
            signal_group(pgid, signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                signal_group(pgid, signal.SIGKILL)
                proc.wait(10)
            # the engine's helper processes share the group; end any that outlived it
            signal_group(pgid, signal.SIGKILL)
            self._proc = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def restart(self) -> float:
        self.stop()
        return self.start()

    def close(self) -> None:
        """Stop the server and remove its temporary directory (the log too, unless given)."""
        self.stop()
        shutil.rmtree(self._work_dir, ignore_errors=True)
        atexit.unregister(self.close)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:]) or "(no log)"
