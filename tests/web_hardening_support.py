"""What the web-hardening end-to-end tests and bench/bench_web_hardening.py share: the
daemon with basic auth as a process, a bounded flood of wrong-password clients, a
scraper that times its scrapes, and many idle sockets.

Everything is loopback (127.0.0.1) and bounded: a flood stops by itself after its
duration, idle sockets are closed by their owner.
"""

from __future__ import annotations

import http.client
import os
import resource
import secrets
import selectors
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bcrypt
import yaml

from harness.process import ManagedProcess, ProcessError, free_port

ROOT = Path(__file__).resolve().parents[1]

USER, PASSWORD = "prometheus", "correct horse"


def basic(user: str, password: str) -> str:
    import base64
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def raise_fd_limit(needed: int) -> int:
    """Raise this process' soft RLIMIT_NOFILE to at least ``needed`` (up to the hard limit);
    returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        soft = want
    return soft


def get(port: int, path: str = "/metrics", password: str | None = PASSWORD, timeout: float = 5.0,
        conn: http.client.HTTPConnection | None = None) -> tuple[int, bytes]:
    """One GET (on ``conn`` when given, else a new connection closed afterwards)."""
    own = conn is None
    c = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        headers = {"Authorization": basic(USER, password)} if password is not None else {}
        c.request("GET", path, headers=headers)
        resp = c.getresponse()
        return resp.status, resp.read()
    finally:
        if own:
            c.close()


@contextmanager
def auth_daemon(workdir: Path, root: Path = ROOT, rounds: int = 10, mode: str = "serve") -> Iterator[ManagedProcess]:
    """The daemon from ``root``'s source tree on a free loopback port with basic auth
    (USER/PASSWORD, bcrypt cost ``rounds``); yields the process (``.port`` set) once /-/ready
    answers 200 to the right password.

    ``mode`` "serve": `kvledger serve` accounting one simulated engine whose ledger server
    runs in this process (the daemon does what it does in production: poll, account,
    serve); "demo": `kvledger demo`, which also simulates nine engines and their GPUs in
    its own process (far more work competing with the server for the interpreter)."""
    workdir.mkdir(parents=True, exist_ok=True)
    web = workdir / "web-config.yml"
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=rounds)).decode()
    web.write_text(yaml.safe_dump({"basic_auth_users": {USER: hashed}}))
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root / "exporter"), str(root / "engine"), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    with ExitStack() as stack:
        if mode == "serve":
            from kvledger.sim.demo import demo_profiles
            from kvledger.sim.engine import SimEngine
            from kvledger_engine.document_server import serve_http

            engine = SimEngine(demo_profiles()[0], seed=1).start()
            stack.callback(engine.stop)
            ledger = serve_http(engine.document)
            stack.callback(ledger.stop)
            config = workdir / "kvledger.yml"
            config.write_text(yaml.safe_dump({"interval_seconds": 1.0, "nvml": {"enabled": False},
                                              "engines": [{"name": "sim", "kind": "ledger", "url": ledger.url}]}))
            args = ["serve", "--config", str(config)]
        else:
            args = ["demo"]
        proc = ManagedProcess([sys.executable, "-m", "kvledger.cli", *args, "--listen", f"127.0.0.1:{port}",
                               "--web.config.file", str(web)], workdir / "kvledger.log", cwd=workdir, env=env)
        stack.callback(proc.stop)
        proc.port = port  # type: ignore[attr-defined]
        deadline = time.monotonic() + 30
        while True:
            if not proc.running():
                raise ProcessError(f"kvledger exited early:\n{proc.log_tail()}")
            try:
                if get(port, "/-/ready", timeout=2)[0] == 200:
                    break
            except (OSError, http.client.HTTPException):
                pass
            if time.monotonic() > deadline:
                raise ProcessError(f"kvledger not ready:\n{proc.log_tail()}")
            time.sleep(0.2)
        yield proc


def scrape_job(port: int, name: str = "kvledger", password: str = PASSWORD) -> dict[str, Any]:
    return {"job_name": name, "scrape_interval": "1s", "scrape_timeout": "1s",
            "basic_auth": {"username": USER, "password": password},
            "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}


@dataclass
class Flood:
    """``clients`` threads sending GET /metrics with wrong passwords on keep-alive
    connections for ``seconds`` (then they stop by themselves). ``mode`` "fixed": each
    client repeats its own wrong password (a misconfigured or hostile client); "random": a
    new random password every request (a brute force). Counts the answers by status."""

    port: int
    clients: int
    seconds: float
    mode: str = "fixed"
    statuses: Counter[str] = field(default_factory=Counter)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Flood:
        deadline = time.monotonic() + self.seconds
        for i in range(self.clients):
            t = threading.Thread(target=self._client, args=(i, deadline), daemon=True, name=f"flood-{i}")
            t.start()
            self._threads.append(t)
        return self

    def _client(self, i: int, deadline: float) -> None:
        fixed = f"wrong-{i}-{secrets.token_hex(4)}"
        conn: http.client.HTTPConnection | None = None
        local: Counter[str] = Counter()
        while time.monotonic() < deadline and not self._stop.is_set():
            if conn is None:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
            password = fixed if self.mode == "fixed" else secrets.token_hex(8)
            try:
                conn.request("GET", "/metrics", headers={"Authorization": basic(USER, password)})
                resp = conn.getresponse()
                resp.read()
                local[str(resp.status)] += 1
                if resp.will_close:
                    conn.close()
                    conn = None
            except (OSError, http.client.HTTPException) as exc:
                local[type(exc).__name__] += 1
                conn.close()
                conn = None
                time.sleep(0.01)
        if conn is not None:
            conn.close()
        with self._lock:
            self.statuses.update(local)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=15)

    def __enter__(self) -> Flood:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class Scraper:
    """A scraper with the right password: GET /metrics every ``interval`` seconds, on a
    kept-alive connection (``keep_alive``) or a new one each time, timing each; stops by
    itself after ``seconds``. ``latencies`` are successful scrapes (seconds),
    ``failures`` (time, what) the others."""

    port: int
    seconds: float
    interval: float = 0.1
    keep_alive: bool = True
    timeout: float = 5.0
    latencies: list[float] = field(default_factory=list)
    failures: list[tuple[float, str]] = field(default_factory=list)
    _thread: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Scraper:
        self._thread = threading.Thread(target=self._run, daemon=True, name="scraper")
        self._thread.start()
        return self

    def _run(self) -> None:
        deadline = time.monotonic() + self.seconds
        conn: http.client.HTTPConnection | None = None
        while time.monotonic() < deadline and not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
                status, body = get(self.port, conn=conn)
                if status == 200 and b"kvledger_build_info" in body:
                    self.latencies.append(time.perf_counter() - t0)
                else:
                    self.failures.append((time.monotonic(), f"HTTP {status}"))
            except (OSError, http.client.HTTPException) as exc:
                self.failures.append((time.monotonic(), type(exc).__name__))
                if conn is not None:
                    conn.close()
                conn = None
            if not self.keep_alive and conn is not None:
                conn.close()
                conn = None
            self._stop.wait(self.interval)
        if conn is not None:
            conn.close()

    def join(self) -> None:
        """Wait until it stops by itself (after ``seconds``)."""
        if self._thread is not None:
            self._thread.join(timeout=self.seconds + 3 * self.timeout + 15)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)

    def summary(self) -> dict[str, float]:
        ordered = sorted(self.latencies) or [float("nan")]
        pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]
        return {"scrapes": len(self.latencies), "failures": len(self.failures), "p50_ms": pick(0.5) * 1e3,
                "p99_ms": pick(0.99) * 1e3, "max_ms": ordered[-1] * 1e3}


def open_idle(port: int, n: int, batch: int = 256, budget: float = 60.0) -> list[socket.socket]:
    """``n`` established TCP connections to 127.0.0.1:``port`` that send nothing.

    Opened ``batch`` at a time, each batch connected before the next is started: a burst
    of thousands of SYNs at once would overflow the kernel's listen queue (the backlog),
    whose dropped SYNs are retried only after 1, 3, 7 ... s, so the connections would
    take minutes to exist. Stops after ``budget`` seconds (AssertionError: fewer exist)."""
    raise_fd_limit(n + 1024)
    socks: list[socket.socket] = []
    deadline = time.monotonic() + budget
    try:
        with selectors.DefaultSelector() as sel:
            while len(socks) < n:
                pending = set()
                for _ in range(min(batch, n - len(socks))):
                    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                    s.setblocking(False)
                    s.connect_ex(("127.0.0.1", port))
                    socks.append(s)
                    sel.register(s, selectors.EVENT_WRITE)
                    pending.add(s)
                while pending:
                    assert time.monotonic() < deadline, f"{len(socks) - len(pending)} of {n} connections within {budget} s"
                    for key, _ in sel.select(timeout=0.5):
                        sock = key.fileobj
                        assert isinstance(sock, socket.socket)
                        sel.unregister(sock)
                        pending.discard(sock)
                        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                        assert err == 0, f"connect: {os.strerror(err)}"
    except BaseException:
        close_all(socks)
        raise
    return socks


def close_all(socks: list[socket.socket]) -> None:
    for s in socks:
        s.close()
    socks.clear()


def first_scrape_after(port: int, budget: float, timeout: float = 1.0) -> tuple[float | None, list[str]]:
    """New-connection scrapes until one succeeds: (seconds to the first success, or None
    within ``budget``; what each failed one got)."""
    failures: list[str] = []
    start = time.monotonic()
    while time.monotonic() - start < budget:
        try:
            status, _ = get(port, timeout=timeout)
            if status == 200:
                return time.monotonic() - start, failures
            failures.append(f"HTTP {status}")
        except (OSError, http.client.HTTPException) as exc:
            failures.append(type(exc).__name__)
        time.sleep(0.05)
    return None, failures
