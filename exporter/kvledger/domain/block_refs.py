"""A compact, read-only sequence of BlockRef backed by arrays.

A ledger with a million blocks cannot afford a million Python objects per poll
(building them costs more than a second). ``BlockRefArray`` stores the three columns
of ``block_refs`` (block id, reference count, cached flag) as machine arrays and
behaves as a ``Sequence[BlockRef]``: iterating or indexing builds ``BlockRef`` objects
on demand. Code that needs speed reads the columns directly (``ids``,
``ref_counts``, ``cached``), e.g. ``len(a) - a.ref_counts.count(0)`` counts blocks
with a reference.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import overload

from kvledger.domain.facts import BlockRef


class BlockRefArray(Sequence[BlockRef]):
    __slots__ = ("cached", "ids", "ref_counts")

    def __init__(self, ids: array[int], ref_counts: array[int], cached: bytes) -> None:
        if not len(ids) == len(ref_counts) == len(cached):
            raise ValueError("block_refs columns differ in length")
        self.ids = ids  # array('Q')
        self.ref_counts = ref_counts  # array('Q')
        self.cached = cached  # bytes of 0/1

    @classmethod
    def from_refs(cls, refs: Iterable[BlockRef | tuple[int, int, bool]]) -> BlockRefArray:
        ids, counts, cached = array("Q"), array("Q"), bytearray()
        for ref in refs:
            if isinstance(ref, BlockRef):
                ids.append(ref.block_id)
                counts.append(ref.ref_count)
                cached.append(1 if ref.cached else 0)
            else:
                ids.append(ref[0])
                counts.append(ref[1])
                cached.append(1 if ref[2] else 0)
        return cls(ids, counts, bytes(cached))

    def __len__(self) -> int:
        return len(self.ids)

    @overload
    def __getitem__(self, index: int) -> BlockRef: ...

    @overload
    def __getitem__(self, index: slice) -> BlockRefArray: ...

    def __getitem__(self, index: int | slice) -> BlockRef | BlockRefArray:
        if isinstance(index, slice):
            return BlockRefArray(self.ids[index], self.ref_counts[index], self.cached[index])
        return BlockRef(self.ids[index], self.ref_counts[index], bool(self.cached[index]))

    def __iter__(self) -> Iterator[BlockRef]:
        return map(BlockRef, self.ids, self.ref_counts, map(bool, self.cached))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockRefArray):
            return self.ids == other.ids and self.ref_counts == other.ref_counts and self.cached == other.cached
        if isinstance(other, Sequence):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __hash__(self) -> int:  # a mutable-looking container: not hashable
        raise TypeError("BlockRefArray is not hashable")

    def __repr__(self) -> str:
        return f"BlockRefArray({len(self)} blocks)"
