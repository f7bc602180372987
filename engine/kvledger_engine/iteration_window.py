"""The engine's recent iterations: tokens scheduled per iteration over a short window.

An in-engine ledger records every scheduling step (``record``); its document states the
window's total scheduled tokens and iteration count (``budgets.window_scheduled_tokens``,
``budgets.window_iterations``), from which the daemon's token_budget saturation takes the
mean tokens per iteration. A sample of the latest iteration alone says little: a prefill
step may fill the budget while the decode steps around it use a fraction of it.

Standard library only (it runs inside engines).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

#: seconds of iterations the window holds
WINDOW_SECONDS = 5.0


class IterationWindow:
    """Scheduled tokens of the iterations of the last ``seconds`` (monotonic clock)."""

    def __init__(self, seconds: float = WINDOW_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = seconds
        self._clock = clock
        self._steps: deque[tuple[float, int]] = deque()
        self._tokens = 0
        self.recorded = False  # whether any iteration was ever recorded (else the window is unknown)

    def _expire(self, now: float) -> None:
        steps, horizon = self._steps, now - self.seconds
        while steps and steps[0][0] < horizon:
            self._tokens -= steps.popleft()[1]

    def record(self, tokens: int) -> None:
        now = self._clock()
        self._expire(now)
        self._steps.append((now, tokens))
        self._tokens += tokens
        self.recorded = True

    def totals(self) -> tuple[int, int]:
        """(scheduled tokens, iterations) within the window now."""
        self._expire(self._clock())
        return self._tokens, len(self._steps)

    def budgets(self) -> dict[str, int]:
        """The document's window fields (none until an iteration was recorded: unknown, not idle)."""
        if not self.recorded:
            return {}
        tokens, iterations = self.totals()
        return {"window_scheduled_tokens": tokens, "window_iterations": iterations}
