"""A small FCFS scheduler with vLLM 0.32's structure (vllm/v1/core/sched/scheduler.py).

``schedule()`` serves running requests first (allocating slots, preempting the last
running request when the pool is full), then admits waiting ones (prefix-cache hits,
chunked prefill) unless it preempted; ``update_from_output()`` appends sampled tokens
and finishes requests (freeing their blocks; their ids go out with the next step);
``finish_requests()`` aborts from outside. The attributes kvledger reads have vLLM's
names and meanings.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable

from vllm.config import VllmConfig
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.request import Request, RequestStatus


class PauseState(enum.IntEnum):
    UNPAUSED = 0
    PAUSED_NEW = 1
    PAUSED_ALL = 2


class Scheduler:
    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, block_size: int | None = None, log_stats: bool = False) -> None:
        self.vllm_config = vllm_config
        self.scheduler_config = vllm_config.scheduler_config
        self.kv_cache_config = kv_cache_config
        self.log_stats = log_stats
        self.max_num_running_reqs = self.scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = self.scheduler_config.max_num_batched_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.block_size = block_size or vllm_config.cache_config.block_size
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.reset_preempted_req_ids: set[str] = set()
        self.num_lookahead_tokens = vllm_config.num_lookahead_tokens
        self.kv_cache_manager = KVCacheManager(
            kv_cache_config, self.max_model_len, enable_caching=vllm_config.cache_config.enable_prefix_caching
        )
        self._pause_state = PauseState.UNPAUSED
        self.shut_down = False
        self.steps = 0

    # -------------------------------------------------------------- one step
    def schedule(self) -> SchedulerOutput:
        self.steps += 1
        budget = self.max_num_scheduled_tokens
        scheduled: dict[str, int] = {}
        new_ids: list[str] = []
        preempted = False
        if self._pause_state != PauseState.PAUSED_ALL:
            i = 0
            while i < len(self.running) and budget > 0:
                request = self.running[i]
                num_new = min(request.num_tokens - request.num_computed_tokens, budget,
                              self.max_model_len - 1 - request.num_computed_tokens)  # fmt: skip
                if num_new <= 0:
                    i += 1
                    continue
                while True:
                    blocks = self.kv_cache_manager.allocate_slots(request, num_new, num_lookahead_tokens=self.num_lookahead_tokens)
                    if blocks is not None:
                        break
                    victim = self.running.pop()  # the last one (FCFS)
                    self._preempt_request(victim)
                    preempted = True
                    if victim is request:
                        break
                if blocks is None:
                    break
                scheduled[request.request_id] = num_new
                budget -= num_new
                i += 1
            while (not preempted and self._pause_state == PauseState.UNPAUSED and self.waiting and budget > 0
                   and len(self.running) < self.max_num_running_reqs):  # fmt: skip
                request = self.waiting[0]
                computed_blocks, num_computed = self.kv_cache_manager.get_computed_blocks(request)
                num_new = min(request.num_tokens - num_computed, budget)
                blocks = self.kv_cache_manager.allocate_slots(
                    request, num_new, num_computed, computed_blocks, num_lookahead_tokens=self.num_lookahead_tokens
                )
                if blocks is None:
                    break
                self.waiting.popleft()
                self.running.append(request)
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = num_computed
                scheduled[request.request_id] = num_new
                new_ids.append(request.request_id)
                budget -= num_new
        output = SchedulerOutput(
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=self.reset_preempted_req_ids,
            scheduled_new_req_ids=new_ids,
        )
        self._update_after_schedule(output)
        return output

    def _update_after_schedule(self, output: SchedulerOutput) -> None:
        for rid, n in output.num_scheduled_tokens.items():
            self.requests[rid].num_computed_tokens += n
        # new sets: the output keeps the old ones
        self.finished_req_ids = set()
        self.reset_preempted_req_ids = set()

    def _preempt_request(self, request: Request) -> None:
        assert request.status == RequestStatus.RUNNING
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        self.reset_preempted_req_ids.add(request.request_id)

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[str]:
        """Append the sampled token of each request that finished its prefill or decoded;
        returns the ids that finished (stop token, max_tokens or max_model_len)."""
        stopped: list[Request] = []
        for rid in output.num_scheduled_tokens:
            request = self.requests.get(rid)
            if request is None or request.is_finished() or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted since
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk: nothing sampled yet
            token = sampled.get(rid, 7)
            request.append_output_token_ids(token)
            if token == request.eos_token_id:
                request.status = RequestStatus.FINISHED_STOPPED
            elif (request.max_tokens is not None and request.num_output_tokens >= request.max_tokens) or request.num_tokens >= self.max_model_len:
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            if request.is_finished():
                stopped.append(request)
        if stopped:
            gone = {id(r) for r in stopped}
            self.running = [r for r in self.running if id(r) not in gone]
            for request in stopped:
                self._free_request(request)
        return [r.request_id for r in stopped]

    # -------------------------------------------------------------- from outside
    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, "duplicate request id"
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def finish_requests(self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus) -> list[Request]:
        assert RequestStatus.is_finished(finished_status)
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        elif request_ids is not None:
            request_ids = set(request_ids)
        else:
            request_ids = self.requests.keys()
        valid = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished():
                continue
            valid.append(request)
        gone = {id(r) for r in valid}
        self.running = [r for r in self.running if id(r) not in gone]
        self.waiting = deque(r for r in self.waiting if id(r) not in gone)
        for request in valid:
            request.status = finished_status
            self._free_request(request)
        return valid

    def _free_request(self, request: Request) -> None:
        assert request.is_finished()
        self.finished_req_ids.add(request.request_id)
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        if reset_running_requests:
            while self.running:
                self._preempt_request(self.running.pop())
        return self.kv_cache_manager.reset_prefix_cache()

    @property
    def pause_state(self) -> PauseState:
        return self._pause_state

    def set_pause_state(self, pause_state: PauseState) -> None:
        self._pause_state = pause_state

    def get_kv_cache_usage(self) -> float:
        return self.kv_cache_manager.usage

    def get_request_counts(self) -> tuple[int, int]:
        return len(self.running), len(self.waiting)

    def has_finished_requests(self) -> bool:
        return bool(self.finished_req_ids)

    def has_requests(self) -> bool:
        return bool(self.running or self.waiting or self.finished_req_ids)

    def shutdown(self) -> None:
        self.shut_down = True

