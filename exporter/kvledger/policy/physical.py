"""Physical state of a pool in unique blocks: in use, reclaimable, allocated, free."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvledger.domain.accounts import Physical
from kvledger.domain.block_refs import BlockRefArray
from kvledger.domain.facts import (
    BlockRef,
    PoolFacts,
)
from kvledger.domain.measure import Measure

# ---------------------------------------------------------------- physical state


def exact_physical(
    in_use: int, reclaimable: int, capacity: int, references: int | None, shared: int | None, derived: bool = False
) -> Physical:
    """allocated = in_use + reclaimable; free = C - allocated."""
    allocated = in_use + reclaimable
    return Physical(
        Measure(exact=in_use),
        Measure(exact=reclaimable),
        Measure(exact=allocated),
        Measure(exact=capacity - allocated),
        references,
        shared,
        derived=derived,
    )


def physical_from_block_refs(refs: Sequence[BlockRef], capacity: int) -> Physical:
    """in_use: blocks with refcount > 0; reclaimable: cached blocks with refcount 0;
    references: sum of refcounts; shared: blocks with refcount > 1 (numpy columns, so a
    million-block ledger stays within the accounting budget)."""
    if isinstance(refs, BlockRefArray):
        counts = np.frombuffer(refs.ref_counts, dtype=np.uint64) if len(refs) else np.zeros(0, dtype=np.uint64)
        cached = np.frombuffer(refs.cached, dtype=np.uint8) if len(refs) else np.zeros(0, dtype=np.uint8)
    else:
        counts = np.fromiter((r.ref_count for r in refs), dtype=np.uint64, count=len(refs))
        cached = np.fromiter((r.cached for r in refs), dtype=np.uint8, count=len(refs))
    referenced = counts > 0
    return exact_physical(
        in_use=int(np.count_nonzero(referenced)),
        reclaimable=int(np.count_nonzero(~referenced & (cached != 0))),
        capacity=capacity,
        references=int(counts.sum(dtype=np.uint64)),
        shared=int(np.count_nonzero(counts > 1)),
        derived=True,
    )


def physical_state(pool: PoolFacts) -> Physical:
    """in_use, reclaimable, allocated = in_use + reclaimable, free = C - allocated.

    Exact from block_refs or from reported in_use and reclaimable; with only in_use
    (U) and a cached-block count H (KV events), the unreferenced blocks C - U hold the
    reclaimable ones: reclaimable lies in [max(0, H - U), min(H, C - U)].
    """
    c = pool.num_blocks
    if pool.block_refs is not None:
        return physical_from_block_refs(pool.block_refs, c)
    u = pool.in_use
    if u is not None and pool.reclaimable is not None:
        return exact_physical(u, pool.reclaimable, c, pool.references, pool.shared)
    if u is not None and pool.free is not None:
        # reclaimable = C - U - free
        return exact_physical(u, c - u - pool.free, c, pool.references, pool.shared)
    if u is not None and pool.cached_blocks is not None:
        h = pool.cached_blocks
        unreferenced = max(0, c - u)
        rec = Measure.bounds(max(0, h - u), min(h, unreferenced))
        assert rec is not None
        return Physical(
            Measure(exact=u),
            rec,
            rec.shift(u),
            rec.negate().shift(c - u),
            pool.references,
            pool.shared,
        )
    if u is not None and pool.unreferenced_blocks is not None:
        # The engine states the blocks no request references (F), free and reclaimable
        # together (TensorRT-LLM counts reusable cached blocks as free): each of free and
        # reclaimable lies in [0, F] and allocated in [U, U + F]. Only the informative
        # side is exported: a zero lower bound would read as a zero.
        f = pool.unreferenced_blocks
        part = Measure.bounds(0 if f == 0 else None, f)
        assert part is not None
        return Physical(
            Measure(exact=u),
            part,
            Measure.bounds(u, u + f),
            part,
            pool.references,
            pool.shared,
        )
    if u is None and pool.in_use_bounds is not None:
        # a reading that is no whole number of blocks: in use lies between its floor and ceiling
        lower, upper = pool.in_use_bounds
        return Physical(Measure.bounds(lower, upper), None, None, None, pool.references, pool.shared)
    return Physical(Measure.of(u), None, None, None, pool.references, pool.shared)
