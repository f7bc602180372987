"""The KV-cache configuration the scheduler holds (vllm/v1/kv_cache_interface.py), reduced."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class FullAttentionSpec:
    block_size: int
    page_size_bytes: int = 0
    sliding_window: int | None = None


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """DeepSeek's latent attention: full attention for the allocator."""


@dataclass(frozen=True)
class SlidingWindowSpec:
    block_size: int
    sliding_window: int
    page_size_bytes: int = 0


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec:
    block_size: int
    attention_chunk_size: int
    page_size_bytes: int = 0


@dataclass(frozen=True)
class MambaSpec:
    block_size: int
    mamba_cache_mode: str = "align"
    num_speculative_blocks: int = 0
    num_prefill_checkpoint_blocks: int = 0
    page_size_bytes: int = 0


@dataclass(frozen=True)
class CrossAttentionSpec:
    block_size: int
    page_size_bytes: int = 0


@dataclass
class KVCacheTensor:
    size: int  # total size of the backing allocation in bytes
    layers: list[str] = field(default_factory=list)
    layer_stride: int = 0
    block_stride: int = 0
    offset: int = 0
    host_resident: bool = False


@dataclass
class KVCacheGroupSpec:
    layer_names: list[str]
    kv_cache_spec: FullAttentionSpec | SlidingWindowSpec | ChunkedLocalAttentionSpec | MambaSpec | CrossAttentionSpec
    host_resident: bool = False


@dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor]
    kv_cache_groups: list[KVCacheGroupSpec]
