"""The engine-thread half of the in-engine vLLM ledger: incremental, and knows no vLLM.

``PoolTracker`` keeps, per block id, the reference count and whether the block holds
cached (hashed) data, with the pool summary (in use, references, shared, cached and
unreferenced) updated by difference. The engine's own block pool tells it which blocks
changed (``dirty``, filled by the wrappers in ``internals``); reading them is the only
per-block work, so a publication costs what changed, never what the pool holds.

``RequestTracker`` keeps the set of request ids touched since the last publication
(scheduled, added, finished, preempted); a publication reads exactly those.

``Throttle`` decides when to publish: never more often than ``min_interval`` seconds and
never more than ``1 / cost_ratio`` of the wall time (a publication that took 1 ms waits
at least ``cost_ratio`` ms before the next), but always when the engine goes idle, so
the last state before a pause is the one served.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

#: (ref_count, cached) of one block, as the engine's pool holds it now
BlockReader = Callable[[int], tuple[int, bool]]


@dataclass(frozen=True, slots=True)
class PoolSummary:
    """The physical state of the pool over its usable blocks (the null block excluded)."""

    in_use: int
    reclaimable: int
    free: int
    references: int
    shared: int | None  # None: the engine does not say (written as null: unknown)
    # blocks in use per KV-cache group (index order) when several share the pool
    group_in_use: tuple[int, ...] = ()


class PoolTracker:
    """Per-block state mirrored from the engine's block pool, summary kept by difference.

    ``capacity`` counts the usable blocks; block ids run from 0 to ``num_ids - 1`` and
    the ids in ``ignored`` (vLLM's null block) are never counted.
    """

    def __init__(self, num_ids: int, capacity: int, ignored: Iterable[int] = (), groups: int = 1) -> None:
        self.num_ids = num_ids
        self.capacity = capacity
        self.ignored = frozenset(ignored)
        self.dirty: set[int] = set()  # block ids the engine changed since the last publication
        self.resync_needed = True  # the first publication reads every block
        self.resyncs = 0  # full reads after the first (a reset, or a disagreement found)
        self._ref = [0] * num_ids
        self._cached = bytearray(num_ids)
        self.in_use = 0
        self.references = 0
        self.shared = 0
        self.unreferenced_cached = 0
        # KV-cache groups sharing the pool (a hybrid model): the group each block was last
        # seen in (index + 1; 0 = not seen in any request's block table) and the blocks in
        # use per owner, kept by difference like the summary (``assign`` moves a block)
        self.groups = groups
        self._owner = bytearray(num_ids)
        self.group_in_use = [0] * (groups + 1)

    def assign(self, bid: int, group: int) -> None:
        """Block ``bid`` is in a block table of group ``group`` (0-based) now."""
        owner = group + 1
        old = self._owner[bid]
        if old != owner:
            self._owner[bid] = owner
            if self._ref[bid] > 0:
                self.group_in_use[old] -= 1
                self.group_in_use[owner] += 1

    def _set(self, bid: int, ref: int, cached: bool) -> None:
        old_ref = self._ref[bid]
        old_cached = self._cached[bid]
        if old_ref == ref and old_cached == cached:
            return
        self.references += ref - old_ref
        used = (ref > 0) - (old_ref > 0)
        self.in_use += used
        if used:
            self.group_in_use[self._owner[bid]] += used
        self.shared += (ref > 1) - (old_ref > 1)
        self.unreferenced_cached += (ref == 0 and cached) - (old_ref == 0 and old_cached == 1)
        self._ref[bid] = ref
        self._cached[bid] = 1 if cached else 0

    def refresh(self, read: BlockReader) -> int:
        """Re-read the dirty blocks (every block after a reset); return how many were read."""
        if self.resync_needed:
            return self.resync(read)
        dirty, self.dirty = self.dirty, set()
        ignored = self.ignored
        for bid in dirty:
            if bid not in ignored and 0 <= bid < self.num_ids:
                ref, cached = read(bid)
                self._set(bid, ref, cached)
        return len(dirty)

    def resync(self, read: BlockReader) -> int:
        """Read every block (at start, after a prefix-cache reset, after a disagreement)."""
        self.dirty = set()
        self.resync_needed = False
        for bid in range(self.num_ids):
            if bid not in self.ignored:
                ref, cached = read(bid)
                self._set(bid, ref, cached)
        return self.num_ids

    def clear(self) -> None:
        """Every block free and uncached: the state a successful prefix-cache reset leaves
        (vLLM resets only when no block is in use). O(blocks), at C speed."""
        self.dirty = set()
        self.resync_needed = False
        self._ref = [0] * self.num_ids
        self._cached = bytearray(self.num_ids)
        self.in_use = self.references = self.shared = self.unreferenced_cached = 0
        self.group_in_use = [0] * (self.groups + 1)

    def summary(self) -> PoolSummary:
        allocated = self.in_use + self.unreferenced_cached
        return PoolSummary(
            in_use=self.in_use,
            reclaimable=self.unreferenced_cached,
            free=self.capacity - allocated,
            references=self.references,
            shared=self.shared,
            group_in_use=tuple(self.group_in_use[1:]) if self.groups > 1 else (),
        )


class RequestTracker:
    """Request ids whose row may have changed since the last publication."""

    def __init__(self) -> None:
        self.touched: set[str] = set()

    def take(self) -> set[str]:
        touched, self.touched = self.touched, set()
        return touched


class Throttle:
    """When to publish: see the module docstring."""

    def __init__(self, min_interval: float, cost_ratio: float = 100.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.min_interval = min_interval
        self.cost_ratio = cost_ratio
        self.clock = clock
        self.next_at = 0.0

    def due(self, idle: bool) -> bool:
        return idle or self.clock() >= self.next_at

    def published(self, started: float, cost: float) -> None:
        """Record a publication that began at ``started`` (clock time) and took ``cost`` seconds
        of the engine's time (its own and the document thread's since the last one)."""
        self.next_at = started + max(self.min_interval, cost * self.cost_ratio)
