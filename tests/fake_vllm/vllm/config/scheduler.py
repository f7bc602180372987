"""SchedulerConfig.get_scheduler_cls as in vLLM 0.32 (vllm/config/scheduler.py)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    async_scheduling: bool = False
    scheduler_cls: str | type | None = None

    def get_scheduler_cls(self) -> type:
        if self.scheduler_cls is None:
            if self.async_scheduling:
                from vllm.v1.core.sched.async_scheduler import AsyncScheduler

                return AsyncScheduler
            from vllm.v1.core.sched.scheduler import Scheduler

            return Scheduler
        if not isinstance(self.scheduler_cls, str):
            return self.scheduler_cls
        module, _, name = self.scheduler_cls.rpartition(".")
        cls: Any = getattr(importlib.import_module(module), name)
        return cls
