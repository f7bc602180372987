"""VllmConfig and the parts of it the scheduler reads."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.config.scheduler import SchedulerConfig


@dataclass
class ModelConfig:
    max_model_len: int = 1024


@dataclass
class CacheConfig:
    block_size: int = 32
    enable_prefix_caching: bool = True
    num_gpu_blocks: int | None = None


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1

    def __post_init__(self) -> None:
        # vLLM 0.32: Field(init=False), the rank of this engine core among the DP ranks
        self.data_parallel_index = self.data_parallel_rank

    def reconfigure_for_independent_dp_rank(self) -> None:
        """What vLLM 0.32's engine-core process does for a dense (non-MoE) model's rank:
        it becomes an independent engine, and only data_parallel_index keeps the rank."""
        self.data_parallel_size = 1
        self.data_parallel_rank = 0


@dataclass
class VllmConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_lookahead_tokens: int = 0


__all__ = ["CacheConfig", "ModelConfig", "ParallelConfig", "SchedulerConfig", "VllmConfig"]
