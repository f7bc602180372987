from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SchedulerOutput:
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    preempted_req_ids: set[str] | None = None
    scheduled_new_req_ids: list[str] = field(default_factory=list)
