"""Per-group block bookkeeping (vllm/v1/core/single_type_kv_cache_manager.py), reduced:
full attention, a sliding window and a local-attention chunk whose skipped blocks become the
null block, and a Mamba group that keeps one state block per request (``align`` mode without
prefix hits: a block table as long as the tokens, every entry null but the last state)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import BlockHash, KVCacheBlock


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SingleTypeKVCacheManager:
    def __init__(self, kv_cache_spec: Any, block_pool: BlockPool, kv_cache_group_id: int, enable_caching: bool) -> None:
        self.block_size: int = kv_cache_spec.block_size
        self.kv_cache_spec = kv_cache_spec
        self.block_pool = block_pool
        self.enable_caching = enable_caching
        self.kv_cache_group_id = kv_cache_group_id
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        self.num_cached_block: dict[str, int] = {}
        self._null_block = block_pool.null_block

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return 0

    def find_longest_cache_hit(self, block_hashes: list[BlockHash], max_length: int) -> list[KVCacheBlock]:
        hits: list[KVCacheBlock] = []
        for block_hash in block_hashes[: max_length // self.block_size]:
            cached = self.block_pool.get_cached_block(block_hash, [self.kv_cache_group_id])
            if cached is None:
                break
            hits.append(cached[0])
        return hits

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks: list[KVCacheBlock]) -> int:
        num_required = cdiv(num_tokens, self.block_size)
        num_new = num_required - len(new_computed_blocks) - len(self.req_to_blocks.get(request_id, ()))
        # hits on unreferenced cached blocks take them off the free queue too
        num_evictable = sum(b.ref_cnt == 0 and not b.is_null for b in new_computed_blocks)
        return max(0, num_new) + num_evictable

    def add_local_computed_blocks(self, request_id: str, new_computed_blocks: list[KVCacheBlock]) -> None:
        req_blocks = self.req_to_blocks[request_id]
        assert not req_blocks
        if self.enable_caching:
            self.block_pool.touch(new_computed_blocks)
        req_blocks.extend(new_computed_blocks)
        self.num_cached_block[request_id] = len(req_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        req_blocks = self.req_to_blocks[request_id]
        num_new = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Any, num_tokens: int) -> None:
        num_cached = self.num_cached_block.get(request.request_id, 0)
        num_full = num_tokens // self.block_size
        if num_cached >= num_full:
            return
        self.block_pool.cache_full_blocks(
            request, self.req_to_blocks[request.request_id], num_cached, num_full, self.block_size, self.kv_cache_group_id
        )
        self.num_cached_block[request.request_id] = num_full

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        num_skipped_blocks = self.get_num_skipped_tokens(num_computed_tokens) // self.block_size
        blocks = self.req_to_blocks.get(request_id)
        if not blocks or num_skipped_blocks <= 0:
            return
        freed = []
        for i in range(min(num_skipped_blocks, len(blocks)) - 1, -1, -1):
            if blocks[i] is self._null_block:
                break
            freed.append(blocks[i])
            blocks[i] = self._null_block
        if freed:
            self.block_pool.free_blocks(freed)

    def free(self, request_id: str) -> None:
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self.block_pool.free_blocks(reversed(blocks))


class FullAttentionManager(SingleTypeKVCacheManager):
    pass


class SlidingWindowManager(SingleTypeKVCacheManager):
    def __init__(self, kv_cache_spec: Any, block_pool: BlockPool, kv_cache_group_id: int, enable_caching: bool) -> None:
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id, enable_caching)
        self.sliding_window: int = kv_cache_spec.sliding_window

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def find_longest_cache_hit(self, block_hashes: list[BlockHash], max_length: int) -> list[KVCacheBlock]:
        return []  # (vLLM finds null-padded hits in the window; the fake does not need them)


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    def __init__(self, kv_cache_spec: Any, block_pool: BlockPool, kv_cache_group_id: int, enable_caching: bool) -> None:
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id, enable_caching)
        self.attention_chunk_size: int = kv_cache_spec.attention_chunk_size

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return (num_computed_tokens // self.attention_chunk_size) * self.attention_chunk_size

    def find_longest_cache_hit(self, block_hashes: list[BlockHash], max_length: int) -> list[KVCacheBlock]:
        return []


class MambaManager(SingleTypeKVCacheManager):
    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens - 1

    def find_longest_cache_hit(self, block_hashes: list[BlockHash], max_length: int) -> list[KVCacheBlock]:
        return []

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks: list[KVCacheBlock]) -> int:
        return 1 if cdiv(num_tokens, self.block_size) > len(self.req_to_blocks.get(request_id, ())) else 0

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        req_blocks = self.req_to_blocks[request_id]
        num_new = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(1)
        req_blocks.extend([self._null_block] * (num_new - 1) + new_blocks)
        return new_blocks

    def cache_blocks(self, request: Any, num_tokens: int) -> None:
        return  # states are not cached by the fake

    def free(self, request_id: str) -> None:
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self.block_pool.free_blocks(b for b in reversed(blocks) if b is not self._null_block)
