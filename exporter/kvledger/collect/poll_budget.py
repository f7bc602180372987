"""The daemon's memory budget for engine answers, and what a poll in progress is doing.

Every engine's answer is held in memory while it streams in and while it is parsed; a
parse costs several times the body (a 16 MiB Prometheus text took 170-210 MB of RSS to
parse). The collector polls many engines at once, so their bodies and parses are bounded
together, by one ``MemoryBudget`` (``limits.memory_budget_bytes`` in the configuration):

- the HTTP client takes each chunk of a body from the budget as it streams in (the body
  bytes), then, once the body is complete, ``PARSE_FACTOR - 1`` times its size more for
  the parse that follows;
- what a poll took is given back when the poll ends (``PollContext.finish``), whatever the
  poll did meanwhile;
- an answer that does not fit beside the others in flight is refused at once, with reason
  ``too_large`` and a message naming the budget (the other engines are unaffected; the
  engine is asked again at the next cycle).

``PollContext`` (one per poll, on the polling thread: ``current()``) also records what the
HTTP client saw (when the answer was complete, its bytes and lines), so that a poll that
outlives its timeout while *parsing* is reported as such: "the answer came in 0.4 s,
parsing its 49,000 lines did not end within the 2 s timeout", not as an engine that did
not answer.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from kvledger.config.types import DEFAULT_MEMORY_BUDGET_BYTES

#: a body's parse is taken as costing this many times its size (decoded text, the parser's
#: objects); measured: 10-13x for Prometheus text, 3-5x for kvledger/v1 documents
PARSE_FACTOR = 8
#: the default budget: one answer at the default 16 MiB limit parsed beside others
DEFAULT_MEMORY_BUDGET = DEFAULT_MEMORY_BUDGET_BYTES


class MemoryBudget:
    """Bytes that engine answers may hold at once, all engines together."""

    def __init__(self, total: int = DEFAULT_MEMORY_BUDGET) -> None:
        self.total = total
        self._lock = threading.Lock()
        self.in_use = 0
        self.peak = 0
        self.refused = 0  # answers refused for want of room

    def take(self, n: int) -> bool:
        """Take ``n`` bytes if they fit beside what is in use; False (nothing taken) if not."""
        with self._lock:
            if self.in_use + n > self.total:
                self.refused += 1
                return False
            self.in_use += n
            self.peak = max(self.peak, self.in_use)
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.in_use = max(0, self.in_use - n)


#: the daemon's one budget (``kvledger serve`` sets its total from the configuration)
BUDGET = MemoryBudget()


@dataclass
class PollContext:
    """What one poll holds of the budget and what its HTTP exchanges saw."""

    budget: MemoryBudget
    started: float
    held: int = 0
    answered_at: float | None = None  # when the last answer was complete (monotonic)
    body_bytes: int = 0
    body_lines: int | None = None

    def take(self, n: int) -> bool:
        if not self.budget.take(n):
            return False
        self.held += n
        return True

    def answered(self, size: int, lines: int | None) -> None:
        self.answered_at = time.monotonic()
        self.body_bytes = size
        self.body_lines = lines

    def finish(self) -> None:
        held, self.held = self.held, 0
        if held:
            self.budget.give(held)

    def phase(self, timeout: float) -> str | None:
        """What the poll did past its answer, as a failure message (None while it waits for
        one). The same words at every such poll (it is logged once per change); the sizes
        and times are in ``detail``."""
        if self.answered_at is None:
            return None
        return (f"the engine answered, but reading its answer did not end within the {timeout:g} s timeout: "
                "the answer is too large to read in time (raise timeout_seconds, or lower max_response_lines)")

    def detail(self, now: float) -> str:
        lines = f", {self.body_lines:,} lines" if self.body_lines is not None else ""
        answered_at = self.answered_at or now
        return (f"answered in {answered_at - self.started:.2f} s ({self.body_bytes:,} bytes{lines}), "
                f"read {now - answered_at:.2f} s more")


_local = threading.local()


def current() -> PollContext | None:
    """The poll running on this thread, if any (the collector's; None in other callers)."""
    return getattr(_local, "context", None)


def begin(budget: MemoryBudget | None = None) -> PollContext:
    context = PollContext(budget or BUDGET, time.monotonic())
    _local.context = context
    return context


def end(context: PollContext) -> None:
    context.finish()
    if getattr(_local, "context", None) is context:
        _local.context = None
