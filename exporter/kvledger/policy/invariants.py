"""Invariants: what the facts of a pool must satisfy, and which claims of an engine they break."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from kvledger.domain.accounts import Physical
from kvledger.domain.block_refs import BlockRefArray
from kvledger.domain.facts import (
    PoolFacts,
)
from kvledger.domain.request_table import RequestTable

# ---------------------------------------------------------------- invariants


#: checks whose failure makes the pool's physical state impossible: in_use, reclaimable
#: and free (and what derives from them) are then exported as unknown, never as numbers
PHYSICAL_CHECKS = frozenset(
    (
        "in_use_le_capacity",
        "allocated_le_capacity",
        "reclaimable_nonnegative",
        "free_nonnegative",
        "partition",
        "unreferenced_partition",
    )
)
#: the engine's own used-blocks claim lies outside [0, capacity]: not exported
ENGINE_REPORTED_CHECK = "engine_reported_used_in_range"
#: the engine's own reservation (PoolFacts.reserved_blocks) is below the blocks in use (every
#: block in use is held by an admitted request, within its reservation): the reservation is
#: exported as unknown. Above capacity it is kept: a broken promise the quota alert watches
#: (per-request counting repeats shared blocks; a source whose reservation cannot exceed its
#: pool, like llama.cpp's split slots, derives both from the same slots).
ENGINE_RESERVED_CHECK = "engine_reserved_ge_in_use"
#: the KV-cache groups of a shared pool state more blocks in use than the pool has in use (a
#: block belongs to one group at a time): the groups' in-use figures are exported as unknown
GROUP_IN_USE_CHECK = "groups_in_use_le_in_use"
#: a request's R(r) summed over a pool's KV-cache groups passed ``MAX_RESERVATION``: the
#: pool's reservations (and what derives from them) are exported as unknown
RESERVATION_RANGE_CHECK = "reservation_in_range"


def invariant_violations(pool: PoolFacts, phys: Physical) -> list[str]:
    """Names of the checks this pool's facts violate (docs/design.md §2 invariants), with the
    checks its source reported violated (``PoolFacts.source_violations``)."""
    bad: list[str] = list(pool.source_violations)
    c = pool.num_blocks
    u = phys.in_use.exact if phys.in_use is not None else None
    if u is not None and u > c:
        bad.append("in_use_le_capacity")
    claim = pool.engine_reported_used_blocks
    if claim is not None and not (math.isfinite(claim) and 0 <= claim <= c):
        bad.append(ENGINE_REPORTED_CHECK)
    reserved = pool.reserved_blocks
    if reserved is not None and u is not None and reserved < u:
        bad.append(ENGINE_RESERVED_CHECK)
    group_in_use = [g.in_use for g in pool.groups if g.in_use is not None]
    if u is not None and group_in_use and len(group_in_use) == len(pool.groups) and sum(group_in_use) > u:
        bad.append(GROUP_IN_USE_CHECK)
    if phys.references is not None and u is not None and phys.references < u:
        bad.append("references_ge_in_use")
    if u is not None and phys.shared is not None and u < phys.shared:
        bad.append("in_use_ge_shared")
    if phys.allocated is not None and phys.allocated.lo is not None and phys.allocated.lo > c:
        bad.append("allocated_le_capacity")
    if phys.reclaimable is not None and phys.reclaimable.lo is not None and phys.reclaimable.lo < 0:
        bad.append("reclaimable_nonnegative")
    if phys.free is not None and phys.free.exact is not None and phys.free.exact < 0:
        bad.append("free_nonnegative")
    if (
        not phys.derived
        and pool.in_use is not None
        and pool.reclaimable is not None
        and pool.free is not None
        and pool.in_use + pool.reclaimable + pool.free != c
    ):
        bad.append("partition")
    if (
        not phys.derived
        and pool.in_use is not None
        and pool.unreferenced_blocks is not None
        and pool.in_use + pool.unreferenced_blocks != c
    ):
        bad.append("unreferenced_partition")
    if phys.derived:
        # block-level detail present: the summary fields must agree with it
        checks = (
            ("in_use", pool.in_use, phys.in_use),
            ("reclaimable", pool.reclaimable, phys.reclaimable),
            ("free", pool.free, phys.free),
        )
        for name, reported, derived in checks:
            if reported is not None and derived is not None and derived.exact != reported:
                bad.append(f"summary_{name}")
        if pool.references is not None and pool.references != phys.references:
            bad.append("summary_references")
        if pool.shared is not None and pool.shared != phys.shared:
            bad.append("summary_shared")
    return bad


def _request_invariants(pool: PoolFacts, requests: RequestTable) -> list[str]:
    """Every block a request lists must carry at least as many references as requests list it."""
    if pool.block_refs is None or requests.block_ids is None:
        return []
    counted: dict[int, int] = {}
    for listed in requests.block_ids:
        for bid in listed or ():
            counted[bid] = counted.get(bid, 0) + 1
    if not counted:
        return []
    refs = pool.block_refs
    if isinstance(refs, BlockRefArray):
        ids = np.frombuffer(refs.ids, dtype=np.uint64)
        counts = np.frombuffer(refs.ref_counts, dtype=np.uint64)
        lookup: Callable[[int], int]
        if len(ids) and np.array_equal(ids, np.arange(len(ids), dtype=np.uint64)):
            lookup = lambda bid: int(counts[bid]) if 0 <= bid < len(counts) else 0
        else:
            table = dict(zip(refs.ids, refs.ref_counts, strict=True))
            lookup = lambda bid: table.get(bid, 0)
    else:
        table = {r.block_id: r.ref_count for r in refs}
        lookup = lambda bid: table.get(bid, 0)
    if any(lookup(bid) < n for bid, n in counted.items()):
        return ["block_ids_referenced"]
    return []
