"""When the Accounts will next be read, learnt from the reads so far.

The collector polls every ``interval`` seconds, so that a read finds numbers at most one
poll old; Prometheus reads them far less often (every 15 s to a minute, at one fixed offset
per target). Making the Accounts at every poll then makes most of them for nobody: at a 1 s
poll and a 15 s scrape, fourteen of fifteen busy accounts were thrown away unread. The
collector asks ``ReadCadence`` when the next read is due and makes the Accounts in the last
cycle before it (``Collector._account_due``); a read that comes unforeseen makes them itself,
from the same latest polls (``Collector.latest``).

A reader is who reads (the /metrics handler names the client's address, the OTLP exporter
itself). It has a cadence once its last ``SAMPLES`` reads came at steady intervals (each
within ``TOLERANCE`` of the one before); its next read is then its last plus that interval.
Readers without one change nothing: they are answered from accounts made for them on the
spot. With no reader that has a cadence, every cycle makes its accounts (a daemon nobody
reads, a reader that stopped: as before). Thread safe.
"""

from __future__ import annotations

import threading
from collections import deque
from itertools import pairwise

#: reads that fix a cadence (two intervals)
SAMPLES = 3
#: how far an interval may differ from the one before it and still continue the cadence
TOLERANCE = 0.2
#: readers remembered, the most recent first: bounded whoever reads (a scan of many
#: addresses forgets the oldest)
MAX_READERS = 32


class ReadCadence:
    """The reads of the Accounts by reader, and when the next one is due."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reads: dict[str, deque[float]] = {}

    def record(self, reader: str, at: float) -> None:
        """``reader`` read the Accounts at ``at`` (monotonic seconds)."""
        with self._lock:
            times = self._reads.pop(reader, None)
            if times is None:
                times = deque(maxlen=SAMPLES)
                while len(self._reads) >= MAX_READERS:
                    del self._reads[next(iter(self._reads))]  # the least recent reader
            times.append(at)
            self._reads[reader] = times  # most recent last

    def next_read(self) -> float | None:
        """The earliest next read of a reader with a cadence (monotonic seconds; it may be
        past, for a reader that is late or has stopped); None when no reader has one."""
        with self._lock:
            due = [_next(times) for times in self._reads.values()]
        steady = [t for t in due if t is not None]
        return min(steady) if steady else None

    def forget(self) -> None:
        with self._lock:
            self._reads.clear()


def _next(times: deque[float]) -> float | None:
    """The next read of one reader, if its reads so far keep a cadence."""
    if len(times) < SAMPLES:
        return None
    intervals = [b - a for a, b in pairwise(times)]
    if min(intervals) <= 0:
        return None
    for before, after in pairwise(intervals):
        if abs(after - before) > TOLERANCE * before:
            return None
    return times[-1] + intervals[-1]
