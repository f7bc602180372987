"""KVCacheManager and its coordinator (vllm/v1/core/kv_cache_manager.py), reduced: several
groups share one pool as in vLLM's HybridKVCacheCoordinator, with prefix-cache hits only
when the pool has one group."""

from __future__ import annotations

from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.single_type_kv_cache_manager import (
    ChunkedLocalAttentionManager,
    FullAttentionManager,
    MambaManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
)
from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, KVCacheConfig, MambaSpec, SlidingWindowSpec


class KVCacheCoordinator:
    def __init__(self, kv_cache_config: KVCacheConfig, block_pool: BlockPool, enable_caching: bool) -> None:
        self.block_pool = block_pool
        managers: list[SingleTypeKVCacheManager] = []
        for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            cls: type[SingleTypeKVCacheManager] = FullAttentionManager
            if isinstance(spec, SlidingWindowSpec):
                cls = SlidingWindowManager
            elif isinstance(spec, ChunkedLocalAttentionSpec):
                cls = ChunkedLocalAttentionManager
            elif isinstance(spec, MambaSpec):
                cls = MambaManager
            managers.append(cls(spec, block_pool, group_id, enable_caching))
        self.single_type_managers = tuple(managers)


class KVCacheManager:
    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int, enable_caching: bool = True) -> None:
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self.block_pool = BlockPool(kv_cache_config.num_blocks, enable_caching, hash_block_size=self.block_size)
        self.coordinator = KVCacheCoordinator(kv_cache_config, self.block_pool, enable_caching)

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Any) -> tuple[list[KVCacheBlock], int]:
        if not self.enable_caching or len(self.coordinator.single_type_managers) > 1:
            return [], 0
        # all tokens hit: the last one is recomputed for its logits
        blocks = self.coordinator.single_type_managers[0].find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """New blocks for ``num_new_tokens`` more tokens (and the lookahead), or None when the
        pool cannot supply them (nothing changes then)."""
        computed = list(new_computed_blocks or [])
        rid = request.request_id
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        need_slots = min(num_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        managers = self.coordinator.single_type_managers
        for manager in managers:
            manager.remove_skipped_blocks(rid, request.num_computed_tokens)
        wanted = sum(m.get_num_blocks_to_allocate(rid, need_slots, computed) for m in managers)
        if wanted > self.block_pool.get_num_free_blocks():
            return None
        new_blocks: list[KVCacheBlock] = []
        for manager in managers:
            if computed:
                manager.add_local_computed_blocks(rid, computed)
            new_blocks += manager.allocate_new_blocks(rid, need_slots)
        if self.enable_caching:
            for manager in managers:
                manager.cache_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def free(self, request: Any) -> None:
        for manager in self.coordinator.single_type_managers:
            manager.free(request.request_id)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
