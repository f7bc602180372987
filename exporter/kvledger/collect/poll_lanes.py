"""The polls of a cycle run one after another in one thread, a lane, as long as they are quick.

A poll mostly waits on its engine or decodes, holding the interpreter lock; run at once on
many threads, the polls of a cycle fought over that lock, and spaced apart (each thread
sleeping until its turn) each paid a sleep and a wake-up: the idle daemon's 304 polls cost
twice what the same polls cost one after the other in one thread (docs/performance.md). So
the polls of a cycle queue here and one lane takes them in turn. Isolation stays: when the
next queued poll has waited ``spill_after`` seconds (a tenth of the interval: a slow or
hung engine holds the lanes, or the queue is longer than the lanes get through in that
time, engines far away on the network each poll waiting on its round trip), ``spill``
starts another lane on the rest of the queue, up to the pool's threads; the collector asks it whenever it waits on polls
(``Collector._wait_polls``). A queued poll is not running: it is never timed out (its
timeout starts when it runs).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

#: the share of the poll interval the next queued poll may wait before it gets a lane of its
#: own (``spill_after``): 100 ms at the default 1 s interval, where eight busy engines' polls
#: of 300 KB documents take about 40 ms in turn
SPILL_SHARE = 0.1
#: the least and the most that wait may be, whatever the interval
SPILL_BOUNDS = (0.01, 0.5)


def spill_after(interval: float) -> float:
    """Seconds the next queued poll may wait for a lane at this poll interval."""
    return min(max(SPILL_SHARE * interval, SPILL_BOUNDS[0]), SPILL_BOUNDS[1])


class PollLanes:
    """Polls queued for ``pool``'s threads, taken in turn by as few lanes as keep them moving."""

    def __init__(self, pool: ThreadPoolExecutor, lanes: int, spill_after: float) -> None:
        self.pool = pool
        self.most = max(1, lanes)  # lanes at once: the pool's threads
        self.spill_after = spill_after
        self._lock = threading.Lock()
        self._queue: deque[tuple[Future[Any], Callable[[], Any], float]] = deque()  # (future, poll, when queued)
        self._current: dict[int, float] = {}  # lane -> when its poll started (monotonic; inf: starting)
        self._next_lane = 0
        self._closed = False

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        """Queue ``fn``; its Future ends with what it returns or raises."""
        future: Future[Any] = Future()
        now = time.monotonic()
        with self._lock:
            self._queue.append((future, fn, now))
            # no lane yet, or every lane held by a poll that has run spill_after (a hung engine
            # from an earlier cycle): a lane now rather than after the wait
            if not self._closed and (not self._current or (len(self._current) < self.most and self._stalled(now))):
                self._open_lane()
        return future

    def _stalled(self, now: float) -> bool:  # with self._lock held
        return all(now - started >= self.spill_after for started in self._current.values())

    def spill(self, now: float | None = None) -> bool:
        """Start another lane when the next queued poll has waited ``spill_after`` seconds;
        True when one was started."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._closed or not self._queue or len(self._current) >= self.most:
                return False
            if now - self._queue[0][2] < self.spill_after:
                return False
            self._open_lane()
            return True

    def close(self) -> list[Future[Any]]:
        """Take no more polls: the queued ones are cancelled and returned (the polls running
        end in their lanes)."""
        with self._lock:
            self._closed = True
            queued = [future for future, _, _ in self._queue]
            self._queue.clear()
        for future in queued:
            future.cancel()
        return queued

    def lanes(self) -> int:
        with self._lock:
            return len(self._current)

    def _open_lane(self) -> None:  # with self._lock held
        lane = self._next_lane
        self._next_lane += 1
        self._current[lane] = float("inf")  # starting: not stalled
        try:
            self.pool.submit(self._run, lane)
        except RuntimeError:  # the pool is shut down (a reconfiguration replaced it)
            del self._current[lane]

    def _run(self, lane: int) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    del self._current[lane]
                    return
                future, fn, _ = self._queue.popleft()
                self._current[lane] = time.monotonic()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except BaseException as exc:  # the poll's own outcome (it reports its errors itself)
                future.set_exception(exc)
            else:
                future.set_result(result)
