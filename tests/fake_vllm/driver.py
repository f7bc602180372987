"""Fake engines built the way vLLM's EngineCore builds them, realistic workloads, and a
brute-force recount of the fake engine's state (independent of kvledger).

Import it only inside ``fake_vllm.installed()``.
"""

from __future__ import annotations

import random
import sys
import types
from dataclasses import dataclass, field
from typing import Any

from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import PauseState, Scheduler
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus

EOS = 2


@dataclass
class EngineSpec:
    num_gpu_blocks: int = 128  # the null block included, as vLLM counts them
    block_size: int = 32
    bytes_per_block: int = 16384  # per worker (one tensor-parallel rank)
    max_model_len: int = 1024
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    sliding_window: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    # as vLLM 0.32 runs a dense model's rank: data_parallel_size 1 and data_parallel_rank 0 in
    # the engine core, the rank only in data_parallel_index
    independent_dp_rank: bool = False
    num_lookahead_tokens: int = 0
    async_scheduling: bool = False
    scheduler_cls: str | type | None = None
    enable_prefix_caching: bool = True
    groups: int = 1
    # a hybrid model: one KV-cache group per entry ("full", "mla", "sliding" (window
    # sliding_window or 16), "chunked" (chunk attention_chunk), "mamba", "cross"); overrides
    # sliding_window
    layer_kinds: tuple[str, ...] = ()
    attention_chunk: int = 32
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def block_bytes(self) -> int:
        """What the ledger should state: one block over all layers and tensor-parallel ranks."""
        return self.bytes_per_block * self.tensor_parallel_size


def vllm_config(spec: EngineSpec) -> VllmConfig:
    return VllmConfig(
        model_config=ModelConfig(max_model_len=spec.max_model_len),
        cache_config=CacheConfig(block_size=spec.block_size, enable_prefix_caching=spec.enable_prefix_caching,
                                 num_gpu_blocks=spec.num_gpu_blocks),
        parallel_config=ParallelConfig(
            tensor_parallel_size=spec.tensor_parallel_size,
            pipeline_parallel_size=spec.pipeline_parallel_size,
            data_parallel_size=spec.data_parallel_size,
            data_parallel_rank=spec.data_parallel_rank,
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=spec.max_num_seqs,
            max_num_batched_tokens=spec.max_num_batched_tokens,
            async_scheduling=spec.async_scheduling,
            scheduler_cls=spec.scheduler_cls,
        ),
        num_lookahead_tokens=spec.num_lookahead_tokens,
    )


def group_spec(spec: EngineSpec, kind: str) -> Any:
    b = spec.block_size
    if kind == "sliding":
        return SlidingWindowSpec(block_size=b, sliding_window=spec.sliding_window or 16)
    if kind == "chunked":
        return ChunkedLocalAttentionSpec(block_size=b, attention_chunk_size=spec.attention_chunk)
    if kind == "mamba":
        return MambaSpec(block_size=b)
    if kind == "cross":
        return CrossAttentionSpec(block_size=b)
    if kind == "mla":
        return MLAAttentionSpec(block_size=b)
    return FullAttentionSpec(block_size=b)


def kv_cache_config(spec: EngineSpec) -> KVCacheConfig:
    kv_spec: Any
    if spec.layer_kinds:
        groups = [KVCacheGroupSpec([f"model.layers.{g}.mixer"], group_spec(spec, k)) for g, k in enumerate(spec.layer_kinds)]
    if spec.sliding_window:
        kv_spec = SlidingWindowSpec(block_size=spec.block_size, sliding_window=spec.sliding_window)
    else:
        kv_spec = FullAttentionSpec(block_size=spec.block_size)
    size = spec.num_gpu_blocks * spec.bytes_per_block
    return KVCacheConfig(
        num_blocks=spec.num_gpu_blocks,
        kv_cache_tensors=[
            # two layers viewing one backing allocation, and a host-resident tensor that is no device memory
            KVCacheTensor(size=size, layers=["model.layers.0.self_attn"]),
            KVCacheTensor(size=size, layers=["model.layers.1.self_attn"], offset=size // 2),
            KVCacheTensor(size=size * 10, layers=["host"], host_resident=True),
        ],
        kv_cache_groups=groups if spec.layer_kinds else [
            KVCacheGroupSpec([f"model.layers.{g}.self_attn"], kv_spec) for g in range(spec.groups)],
    )  # fmt: skip


def build_scheduler(spec: EngineSpec) -> Scheduler:
    """What EngineCore does: ask the config for the scheduler class, then build it."""
    config = vllm_config(spec)
    if spec.independent_dp_rank:
        config.parallel_config.reconfigure_for_independent_dp_rank()
    cls = config.scheduler_config.get_scheduler_cls()
    scheduler: Scheduler = cls(vllm_config=config, kv_cache_config=kv_cache_config(spec), block_size=spec.block_size, log_stats=False)
    return scheduler


def plain_scheduler(spec: EngineSpec) -> Scheduler:
    """The scheduler class itself, built without asking the (possibly wrapped) config."""
    config = vllm_config(spec)
    return Scheduler(vllm_config=config, kv_cache_config=kv_cache_config(spec), block_size=spec.block_size, log_stats=False)


def _renamed(code: types.CodeType, old: str, new: str) -> types.CodeType:
    consts = tuple(_renamed(c, old, new) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_names=tuple(new if n == old else n for n in code.co_names), co_consts=consts)


def rename_attribute(old: str, new: str) -> int:
    """What a vLLM release that renames an attribute looks like: every class of the fake
    ``vllm`` uses ``new`` where it used ``old`` (methods, instance and class attributes).
    Returns how many functions changed. (Not for slot attributes of KVCacheBlock.)"""
    changed = 0
    for name, module in list(sys.modules.items()):
        if name != "vllm" and not name.startswith("vllm."):
            continue
        for cls in [v for v in vars(module).values() if isinstance(v, type) and v.__module__ == name]:
            for attr, value in list(vars(cls).items()):
                func = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
                if isinstance(func, types.FunctionType) and old in _all_names(func.__code__):
                    func.__code__ = _renamed(func.__code__, old, new)
                    changed += 1
                if attr == old:
                    setattr(cls, new, value)
                    delattr(cls, old)
    return changed


def _all_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _all_names(c)
    return names


# ---------------------------------------------------------------- workloads


class Workload:
    """Requests arrive with prompts that share a few prefixes, decode, hit the prefix
    cache, get preempted when the pool is full, finish (stop token or max_tokens) or are
    aborted; ``step()`` is one engine iteration (schedule, then the model's output)."""

    def __init__(self, scheduler: Scheduler, seed: int = 0, *, prefixes: int = 3, tenants: tuple[str, ...] = ("alpha", "beta", "")) -> None:
        self.scheduler = scheduler
        self.rng = random.Random(seed)
        self.block_size = scheduler.block_size
        self.prefixes = [[self.rng.randrange(3, 30000) for _ in range(self.block_size * self.rng.randint(1, 4))] for _ in range(prefixes)]
        self.tenants = tenants
        self.next_id = 0
        self.outputs: list[SchedulerOutput] = []

    def add(self, *, prompt_tokens: int | None = None, max_tokens: int | str | None = "random", n_prefix: int | None = None,
            priority: int | None = None, tenant: str | None = "random") -> Request:  # fmt: skip
        rng = self.rng
        prefix = self.prefixes[rng.randrange(len(self.prefixes))] if (n_prefix is None and rng.random() < 0.85) else []
        if n_prefix is not None:
            prefix = self.prefixes[n_prefix % len(self.prefixes)]
        length = prompt_tokens if prompt_tokens is not None else len(prefix) + rng.randint(1, 3 * self.block_size)
        length = min(length, self.scheduler.max_model_len - 2)  # vLLM rejects longer prompts at the API server
        prompt = (prefix + [rng.randrange(3, 30000) for _ in range(length)])[:length]
        limit = self.scheduler.max_model_len - length - 1
        if max_tokens == "random":
            max_tokens = None if rng.random() < 0.15 else rng.randint(1, max(1, min(limit, 8 * self.block_size)))
        assert max_tokens is None or isinstance(max_tokens, int)
        extra: dict[str, Any] | None = None
        if tenant == "random":
            tenant = rng.choice(self.tenants) if self.tenants else None
        if tenant is not None:
            extra = {"kvledger_tenant": tenant}
        request = Request(
            f"req-{self.next_id}", prompt, SamplingParams(max_tokens=max_tokens, extra_args=extra),
            priority=rng.randint(0, 3) if priority is None else priority, block_size=self.block_size, eos_token_id=EOS,
        )  # fmt: skip
        self.next_id += 1
        self.scheduler.add_request(request)
        return request

    def step(self, stop_probability: float = 0.02) -> SchedulerOutput:
        output = self.scheduler.schedule()
        sampled = {rid: (EOS if self.rng.random() < stop_probability else self.rng.randrange(3, 30000)) for rid in output.num_scheduled_tokens}
        self.scheduler.update_from_output(output, sampled)
        self.outputs.append(output)
        return output

    def live_ids(self) -> list[str]:
        return [rid for rid, r in self.scheduler.requests.items() if not r.is_finished()]

    def abort(self, count: int = 1) -> list[str]:
        ids = self.live_ids()
        chosen = self.rng.sample(ids, min(count, len(ids)))
        if chosen:
            self.scheduler.finish_requests(chosen if len(chosen) > 1 else chosen[0], RequestStatus.FINISHED_ABORTED)
        return chosen

    def abort_all(self) -> None:
        self.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)

    def pause(self, paused: bool) -> None:
        self.scheduler.set_pause_state(PauseState.PAUSED_ALL if paused else PauseState.UNPAUSED)

    def drain(self, limit: int = 10_000) -> int:
        """Steps until nothing runs, waits or has finished unreported; returns how many."""
        steps = 0
        while self.scheduler.has_requests():
            self.step()
            steps += 1
            assert steps < limit, "the workload does not drain"
        return steps


# ---------------------------------------------------------------- the brute-force recount

def spec_kind(manager: Any) -> str:
    spec = manager.kv_cache_spec
    if isinstance(spec, SlidingWindowSpec):
        return "sliding"
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return "chunked"
    if isinstance(spec, MambaSpec):
        return "mamba"
    return "full"


STATES = {RequestStatus.RUNNING: "running", RequestStatus.PREEMPTED: "preempted", RequestStatus.WAITING: "waiting"}


def recount(scheduler: Scheduler, tenant_mode: str = "") -> dict[str, Any]:
    """The pool and the requests counted block by block from the fake engine itself."""
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    null = pool.null_block
    usable = [b for b in pool.blocks if b is not null]
    in_use = sum(1 for b in usable if b.ref_cnt > 0)
    reclaimable = sum(1 for b in usable if b.ref_cnt == 0 and b.block_hash is not None)
    # the fake's own consistency: the free queue holds exactly the unreferenced blocks
    assert pool.free_block_queue.num_free_blocks == len(usable) - in_use
    assert all(b.ref_cnt >= 0 for b in usable)
    requests: dict[str, dict[str, Any]] = {}
    for rid, r in scheduler.requests.items():
        if r.is_finished():
            continue
        held = sum(1 for m in manager.coordinator.single_type_managers for b in m.req_to_blocks.get(rid, ()) if b is not null)
        state = STATES[r.status]
        assert state != "waiting" or held == 0
        tenant: str | None = None
        if tenant_mode == "priority":
            tenant = str(r.priority)
        elif tenant_mode == "request":
            value = (r.sampling_params.extra_args or {}).get("kvledger_tenant")
            tenant = value or None
        requests[rid] = {
            "state": state,
            "prompt_tokens": r.num_prompt_tokens,
            "max_output_tokens": r.max_tokens if r.max_tokens is not None else scheduler.max_model_len - r.num_prompt_tokens,
            "generated_tokens": r.num_output_tokens,
            "computed_tokens": r.num_computed_tokens,
            "blocks_held": held,
            "tenant": tenant,
        }
    managers = manager.coordinator.single_type_managers
    group_in_use = [
        len({b.block_id for blocks in m.req_to_blocks.values() for b in blocks if b is not null and b.ref_cnt > 0})
        for m in managers
    ]
    return {
        "groups_in_use": group_in_use if len(managers) > 1 or spec_kind(managers[0]) not in ("full", "sliding") else None,
        "in_use": in_use,
        "reclaimable": reclaimable,
        "free": len(usable) - in_use - reclaimable,
        "references": sum(b.ref_cnt for b in usable),
        "shared": sum(1 for b in usable if b.ref_cnt > 1),
        "requests": requests,
    }
