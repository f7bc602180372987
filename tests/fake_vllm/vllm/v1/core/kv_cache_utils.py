"""KVCacheBlock, the free-block queue and block hashes (vllm/v1/core/kv_cache_utils.py), reduced.

The free queue keeps vLLM's order semantics (popleft from the front, ``prepend_n`` for
uncached blocks reused first, ``append_n`` for cached ones evicted last, ``remove`` from
the middle) on an OrderedDict instead of vLLM's intrusive linked list.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

BlockHash = bytes
BlockHashWithGroupId = bytes


def hash_block_tokens(parent: BlockHash | None, tokens: Sequence[int]) -> BlockHash:
    return hashlib.blake2b(repr((parent, tuple(tokens))).encode(), digest_size=16).digest()


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    return block_hash + group_id.to_bytes(4, "big")


@dataclass(slots=True)
class KVCacheBlock:
    """As in vLLM: a slots dataclass (so ``==`` compares fields and it is unhashable)."""

    block_id: int
    ref_cnt: int = 0
    pool: Any = field(default=None, repr=False, compare=False, kw_only=True)
    _block_hash: BlockHashWithGroupId | None = None
    _block_hash_num_tokens: int | None = None
    is_null: bool = False

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        return self._block_hash

    @property
    def block_hash_num_tokens(self) -> int | None:
        return self._block_hash_num_tokens

    def set_block_hash(self, block_hash: BlockHashWithGroupId, num_tokens: int | None = None) -> None:
        assert self._block_hash is None and self._block_hash_num_tokens is None, "the block already has a hash"
        self._block_hash = block_hash
        self._block_hash_num_tokens = num_tokens

    def reset_hash(self) -> None:
        self._block_hash = None
        self._block_hash_num_tokens = None


class FreeKVCacheBlockQueue:
    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in blocks)
        self.num_free_blocks = len(blocks)

    def popleft(self) -> KVCacheBlock:
        if not self._queue:
            raise ValueError("No free blocks available")
        _, block = self._queue.popitem(last=False)
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} of {self.num_free_blocks} free blocks")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        del self._queue[block.block_id]
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        assert block.block_id not in self._queue, f"block {block.block_id} is already free"
        self._queue[block.block_id] = block
        self.num_free_blocks += 1

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """The blocks go to the front, in their order (blocks[0] first)."""
        for block in reversed(blocks):
            self.append(block)
            self._queue.move_to_end(block.block_id, last=False)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        return list(self._queue.values())
