"""Signals relayed by a thread of their own to a queue: nothing runs in a signal handler, and
nothing the main thread does can hold a stop up.

A Python signal handler runs on the main thread between any two bytecodes, so one that takes
a lock (``Event.set()``, logging, starting a thread) deadlocks whenever the signal lands while
the main thread holds that same non-reentrant lock: inside ``Event.wait()``/``clear()``,
inside ``Thread.start()``, inside a log call. And a handler only runs when the main thread
gets back to bytecode: a main thread blocked in C (a join, a socket) never sees it.

Here the handlers do nothing; ``signal.set_wakeup_fd`` has the interpreter's C-level handler
write each signal's number, as one byte, to a socket. A daemon thread reads the socket and
puts each signal on :attr:`SignalInbox.delivered` for the main thread, which acts on it as
ordinary code; on the first stop signal the thread also runs ``on_stop`` (the daemon's
bounded exit), wherever the main thread is."""

from __future__ import annotations

import queue
import signal
import socket
import threading
from collections.abc import Callable, Iterable
from types import FrameType, TracebackType

#: the byte close() writes to end the relay thread (no signal is numbered 0)
_CLOSED = 0


def _nothing(_signum: int, _frame: FrameType | None) -> None:
    """Installed so the signal is caught (not its default action); the byte on the socket is
    what is acted on."""


class SignalInbox:
    """While open (a context manager, entered on the main thread), each of ``signums``
    delivered to the process is put on :attr:`delivered`; a signal in ``stops`` then runs
    ``on_stop`` in the relay thread (once). The handlers and wake-up fd that were there before
    are put back on close."""

    def __init__(self, signums: Iterable[signal.Signals], stops: Iterable[signal.Signals] = (),
                 on_stop: Callable[[signal.Signals], None] | None = None) -> None:
        self._signums = tuple(signums)
        self._stops = frozenset(stops)
        self._on_stop = on_stop
        self.delivered: queue.SimpleQueue[signal.Signals] = queue.SimpleQueue()
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)  # set_wakeup_fd requires it: the C handler never blocks
        self._previous_fd: int | None = None
        self._previous: dict[signal.Signals, object] = {}
        self._relay = threading.Thread(target=self._run, name="kvledger-signals", daemon=True)

    def __enter__(self) -> SignalInbox:
        try:  # set_wakeup_fd and signal.signal raise ValueError off the main thread
            self._previous_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
            for signum in self._signums:
                self._previous[signum] = signal.signal(signum, _nothing)
            self._relay.start()
        except BaseException:
            self.close()
            raise
        return self

    def next(self) -> signal.Signals:
        """Block until one of the signals arrives (in order) and return it."""
        return self.delivered.get()

    def _run(self) -> None:
        while data := self._reader.recv(64):
            for number in data:
                if number == _CLOSED:
                    return
                if number not in self._signums:
                    continue
                received = signal.Signals(number)
                self.delivered.put(received)
                if received in self._stops and self._on_stop is not None:
                    on_stop, self._on_stop = self._on_stop, None
                    on_stop(received)

    def close(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)  # type: ignore[arg-type]  # what getsignal returned
        self._previous.clear()
        if self._previous_fd is not None:
            signal.set_wakeup_fd(self._previous_fd)
            self._previous_fd = None
        if self._relay.is_alive():
            self._writer.setblocking(True)
            self._writer.send(bytes([_CLOSED]))
            self._relay.join(timeout=1.0)
        if not self._relay.is_alive():  # else it is in on_stop: the process is on its way out
            self._reader.close()
            self._writer.close()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
