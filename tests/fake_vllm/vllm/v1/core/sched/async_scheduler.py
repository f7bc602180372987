from __future__ import annotations

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler


class AsyncScheduler(Scheduler):
    """vLLM's async scheduler overrides _update_after_schedule (output placeholders)."""

    def _update_after_schedule(self, output: SchedulerOutput) -> None:
        super()._update_after_schedule(output)
        self.async_steps = getattr(self, "async_steps", 0) + 1
