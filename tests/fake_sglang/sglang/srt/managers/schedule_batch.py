"""Requests and the running batch (SGLang's ``Req`` and ``ScheduleBatch``, the parts the
plugin reads and the decode retraction)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class SamplingParams:
    max_new_tokens: int


@dataclass
class ReqKvInfo:
    """The KV a request holds (0.5.23 keeps it in ``req.kv``)."""

    req_pool_idx: int | None = None  # its row of req_to_token: it holds KV
    cache_protected_len: int = 0  # the radix cache owns [0, here)
    kv_committed_len: int = 0  # computed up to here
    kv_allocated_len: int = 0  # held in the pool up to here (its cached prefix included)


@dataclass
class NextBatchPlan:
    batch_to_run: ScheduleBatch | None
    running_batch: ScheduleBatch


class Req:
    def __init__(self, rid: str, origin_input_ids: list[int], max_new_tokens: int, *, finish_at: int | None = None,
                 priority: int | None = None) -> None:
        self.rid = rid
        self.origin_input_ids = list(origin_input_ids)
        self.output_ids: list[int] = []
        self.sampling_params = SamplingParams(max_new_tokens)
        self.priority = priority
        self.finish_at = max_new_tokens if finish_at is None else finish_at  # an EOS before the cap
        self.kv = ReqKvInfo()
        self.pages: list[int] = []  # its row of req_to_token, one entry per page
        self.locked: list[tuple[int, ...]] = []  # the radix nodes it locks
        self.is_retracted = False
        self.finished_reason: str | None = None

    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids


class ScheduleBatch:
    def __init__(self, reqs: list[Req], scheduler: Any, *, prefill: bool = False) -> None:
        self.reqs = reqs
        self.scheduler = scheduler
        self.prefill = prefill

    def retract_decode(self) -> tuple[list[Req], float, list[Req]]:
        """Retract running requests (the last admitted first) until the others' next decode
        step fits; (retracted, the new token ratio, requests to abort)."""
        retracted = []
        while len(self.reqs) > 1 and not self.scheduler.decode_fits(self.reqs):
            req = self.reqs.pop()
            self.scheduler.release(req, retract=True)
            retracted.append(req)
        remaining = sum(r.sampling_params.max_new_tokens - len(r.output_ids) for r in self.reqs) or 1
        decoded = sum(len(r.output_ids) for r in self.reqs)
        return retracted, min(1.0, (decoded + 1) / remaining + 0.1), []
