"""kvledger.process.signals, in processes of its own (signals reach a whole process): every
signal is delivered to the main thread as data whatever it is doing, and a stop runs its
``on_stop`` even while the main thread is blocked and never looks."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

from harness.kvledger_daemon import _env

PRELUDE = """
import os, signal, sys, threading, time
from kvledger.process.signals import SignalInbox
"""


def _start(body: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(None))
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read() if proc.stderr else ""
    return proc


def _result(proc: subprocess.Popen[str], limit: float = 15.0) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"still running after {limit}s:\n{out}\n{err}") from None
    return proc.returncode, out, err


def test_on_stop_runs_while_the_main_thread_is_blocked() -> None:
    """The main thread waits on a lock nobody releases; SIGTERM still ends the process."""
    proc = _start("""
        with SignalInbox([signal.SIGTERM], [signal.SIGTERM], on_stop=lambda s: os._exit(40 + s)):
            print("ready", flush=True)
            held = threading.Lock()
            held.acquire()
            held.acquire()
    """)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code, _, err = _result(proc)
    assert code == 40 + signal.SIGTERM, err
    assert time.monotonic() - start < 10


def test_every_signal_reaches_a_main_thread_busy_with_events_and_threads() -> None:
    """The main thread spins in Event.set/clear/wait and Thread.start, whose locks a handler
    that set an Event would deadlock on; a storm of SIGHUPs, then SIGUSR1 to end, all arrive."""
    proc = _start("""
        wake = threading.Event()
        with SignalInbox([signal.SIGHUP, signal.SIGUSR1]) as inbox:
            print("ready", flush=True)
            hups = 0
            while True:
                for _ in range(50):
                    wake.set(); wake.clear(); wake.wait(0.0001)
                    threading.Thread(target=lambda: None).start()
                try:
                    received = inbox.delivered.get_nowait()
                except Exception:
                    continue
                if received == signal.SIGUSR1:
                    break
                hups += 1
        print(hups, flush=True)
    """)
    for _ in range(2000):
        proc.send_signal(signal.SIGHUP)
    time.sleep(0.5)
    proc.send_signal(signal.SIGUSR1)
    code, out, err = _result(proc)
    assert code == 0, err
    assert int(out.strip()) > 0  # signals coalesce in the kernel: some, never all 2000, are separate


def test_close_puts_back_what_was_there() -> None:
    proc = _start("""
        before = signal.getsignal(signal.SIGTERM)
        with SignalInbox([signal.SIGTERM]):
            pass
        assert signal.getsignal(signal.SIGTERM) is before
        assert signal.set_wakeup_fd(-1) == -1
        assert [t.name for t in threading.enumerate()] == ["MainThread"]
        print("ready", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)
    """)
    code, _, err = _result(proc)
    assert code == -signal.SIGTERM, err  # the default action again


def test_off_the_main_thread_it_refuses_and_leaves_nothing_behind() -> None:
    proc = _start("""
        failed = []
        def off_main():
            try:
                with SignalInbox([signal.SIGTERM]):
                    pass
            except ValueError as exc:
                failed.append(str(exc))
        t = threading.Thread(target=off_main)
        t.start(); t.join()
        assert failed, "entered off the main thread"
        assert [t.name for t in threading.enumerate()] == ["MainThread"]
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        print("ready", flush=True)
    """)
    code, _, err = _result(proc)
    assert code == 0, err
