"""BlockPool with vLLM 0.32's semantics (vllm/v1/core/block_pool.py), reduced: no KV events,
no metrics collector, no partial-block entries; one block per hash key in the cache map.

What kvledger's integration relies on is kept: ``blocks``, the null block 0 popped from the
free queue, ``ref_cnt`` and ``block_hash`` per block, and every state change going through
``get_new_blocks``, ``touch``, ``free_blocks``, ``unpin_blocks``, ``_insert_block_hash``,
``_remove_cached_block_hashes`` (eviction, via ``_maybe_evict_cached_block``) or
``reset_prefix_cache`` (which resets hashes directly, as vLLM does). Internal calls go
through ``self.`` so that instance attributes (kvledger's wrappers) see them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    BlockHashWithGroupId,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    make_block_hash_with_group_id,
)


class BlockPool:
    def __init__(self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int) -> None:
        assert isinstance(num_gpu_blocks, int) and num_gpu_blocks > 0
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(idx, pool=self) for idx in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHashWithGroupId, dict[int, KVCacheBlock]] = {}
        # block 0 is a placeholder whose ref_cnt is not maintained; never freed, never cached
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self._reuse_watchers: dict[int, Callable[[KVCacheBlock], None]] = {}

    # -------------------------------------------------------------- prefix cache
    def get_cached_block(self, block_hash: BlockHash, kv_cache_group_ids: list[int]) -> list[KVCacheBlock] | None:
        cached = []
        for group_id in kv_cache_group_ids:
            blocks = self.cached_block_hash_to_block.get(make_block_hash_with_group_id(block_hash, group_id))
            if not blocks:
                return None
            cached.append(next(iter(blocks.values())))
        return cached

    def cache_full_blocks(
        self,
        request: Any,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
    ) -> None:
        if num_cached_blocks >= num_full_blocks:
            return
        for i, blk in enumerate(blocks[num_cached_blocks:num_full_blocks]):
            if blk.is_null:
                continue  # sliding window: a skipped block
            index = num_cached_blocks + i
            key = make_block_hash_with_group_id(request.block_hashes[index], kv_cache_group_id)
            if blk.block_hash is not None:
                self._remove_cached_block_hashes(blk)
            self._insert_block_hash(key, blk, num_tokens=(index + 1) * block_size)

    def _insert_block_hash(self, block_hash_with_group_id: BlockHashWithGroupId, block: KVCacheBlock, num_tokens: int | None) -> None:
        if block.block_hash == block_hash_with_group_id:
            return
        if block.block_id in self.cached_block_hash_to_block.get(block_hash_with_group_id, {}):
            return
        block.set_block_hash(block_hash_with_group_id, num_tokens=num_tokens)
        self.cached_block_hash_to_block.setdefault(block_hash_with_group_id, {})[block.block_id] = block

    def _remove_cached_block_hashes(self, block: KVCacheBlock) -> list[BlockHashWithGroupId]:
        key = block.block_hash
        if key is None:
            return []
        removed = []
        blocks = self.cached_block_hash_to_block.get(key)
        if blocks is not None and blocks.pop(block.block_id, None) is not None:
            removed.append(key)
            if not blocks:
                del self.cached_block_hash_to_block[key]
        block.reset_hash()
        return removed

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        return bool(self._remove_cached_block_hashes(block))

    def evict_blocks(self, block_ids: set[int]) -> None:
        for block_id in block_ids:
            self._maybe_evict_cached_block(self.blocks[block_id])

    # -------------------------------------------------------------- allocation
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        ret = self.free_block_queue.popleft_n(num_blocks)
        for block in ret:
            watcher = self._reuse_watchers.pop(block.block_id, None)
            if watcher is not None:
                watcher(block)
            if self.enable_caching:
                self._maybe_evict_cached_block(block)
            assert block.ref_cnt == 0
            block.ref_cnt += 1
        return ret

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        evict_last = []
        evict_first = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                if block.block_hash is None or not self.enable_caching:
                    evict_first.append(block)
                else:
                    evict_last.append(block)
        self.free_block_queue.prepend_n(evict_first)
        self.free_block_queue.append_n(evict_last)

    def unpin_blocks(self, blocks: Iterable[KVCacheBlock], on_reuse: Callable[[KVCacheBlock], None]) -> None:
        released = []
        for block in blocks:
            assert block.ref_cnt > 0 and not block.is_null
            block.ref_cnt -= 1
            self._reuse_watchers[block.block_id] = on_reuse
            if block.ref_cnt == 0:
                released.append(block)
        self.free_block_queue.append_n(released)

    def reset_prefix_cache(self) -> bool:
        if self.num_gpu_blocks - self.get_num_free_blocks() != 1:  # the null block is always used
            return False
        self.cached_block_hash_to_block = {}
        for block_id in list(self._reuse_watchers):
            self._reuse_watchers.pop(block_id)(self.blocks[block_id])
        for block in self.blocks:
            block.reset_hash()
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        total = self.num_gpu_blocks - 1
        return 1.0 - self.get_num_free_blocks() / total if total else 0.0
