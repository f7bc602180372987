"""Property-based tests of the policy on random ledgers (hypothesis).

The policy's outputs are compared with an independent model written here: the physical
state by walking every block id of the pool, reference counts taken from the requests'
block_ids; reservations by a plain loop over the requests from the formulas of docs/design.md
section 2. Nothing below calls the policy's helpers to compute an expected value.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st
from ledger_checks import design_reservation

from kvledger.domain.accounts import EngineAccount
from kvledger.domain.facts import BlockRef, Budgets, EngineFacts, PoolFacts, RequestFacts
from kvledger.policy.engine_accounts import engine_account

BLOCK = 16
MAX_NUM_SEQS = 16


@st.composite
def ledgers(
    draw: st.DrawFn, all_caps: bool = False, mixed_cache: bool = False
) -> tuple[PoolFacts, list[RequestFacts], int]:
    """A random consistent ledger: requests referencing blocks (some shared), cached blocks.
    ``mixed_cache``: blocks in use hold cached (hashed) data or not, at random."""
    capacity = draw(st.integers(min_value=8, max_value=200))
    max_model_len = draw(st.sampled_from([256, 512, 2048]))
    window = draw(st.one_of(st.none(), st.sampled_from([64, 128])))
    n_prefix = draw(st.integers(min_value=0, max_value=4))
    next_block = 0
    prefix = list(range(n_prefix))
    next_block = n_prefix
    requests: list[RequestFacts] = []
    refcount: dict[int, int] = {}
    for i in range(draw(st.integers(min_value=0, max_value=12))):
        state = draw(st.sampled_from(["running", "running", "waiting", "preempted"]))
        p = draw(st.integers(min_value=1, max_value=300))
        o = draw(st.integers(min_value=0, max_value=300))
        n = draw(st.integers(min_value=1, max_value=3))
        k = draw(st.integers(min_value=0, max_value=4))
        bound = "cap" if all_caps else draw(st.sampled_from(["cap", "estimate"]))
        blocks: list[int] = []
        if state == "running":
            r = design_reservation(p, o, BLOCK, max_model_len=max_model_len, n=n, k=k, window=window)
            own = draw(st.integers(min_value=0, max_value=max(0, r - n_prefix) if all_caps else r + 2))
            if draw(st.booleans()) and (not all_caps or n_prefix <= r):
                blocks.extend(prefix)
            if next_block + own > capacity:
                own = max(0, capacity - next_block)
            blocks.extend(range(next_block, next_block + own))
            next_block += own
        for b in blocks:
            refcount[b] = refcount.get(b, 0) + 1
        computed = draw(st.integers(min_value=len(blocks) * BLOCK - BLOCK + 1, max_value=len(blocks) * BLOCK)) if blocks else 0
        requests.append(RequestFacts(
            id=f"r{i}", state=state, prompt_tokens=p, max_output_tokens=o, output_bound=bound,  # type: ignore[arg-type]
            contexts=n, speculative_slots=k, blocks_held=len(blocks), block_ids=blocks, computed_tokens=max(0, computed)))
    # some prefix blocks not referenced by anyone stay cached (reclaimable); others freed
    refs = [BlockRef(b, refcount.get(b, 0), draw(st.booleans()) if mixed_cache and refcount.get(b, 0) else True)
            for b in range(min(next_block, capacity)) if refcount.get(b, 0) or b < n_prefix]
    n_cached = draw(st.integers(min_value=0, max_value=max(0, capacity - next_block)))
    refs += [BlockRef(b, 0, True) for b in range(next_block, next_block + n_cached)]
    pool = PoolFacts(id="0", block_size=BLOCK, num_blocks=capacity, block_bytes=64, sliding_window=window, block_refs=refs)
    return pool, requests, max_model_len


def account(pool: PoolFacts, requests: list[RequestFacts], max_model_len: int, sharing: str) -> EngineAccount:
    e = EngineFacts(name="e", kind="ledger", source="ledger", pools=[pool], requests=requests,
                    budgets=Budgets(max_model_len=max_model_len, max_num_seqs=MAX_NUM_SEQS))
    return engine_account(e, sharing)


@dataclass(frozen=True)
class Walked:
    in_use: int
    reclaimable: int
    free: int
    references: int
    shared: int


def walk_pool(pool: PoolFacts, requests: list[RequestFacts]) -> Walked:
    """Every block id of the pool, one by one: in use when some request references it,
    reclaimable when none does but it holds cached data, free otherwise. References and
    shared blocks (two or more references) are counted from the requests' block_ids."""
    refs = Counter(b for r in requests for b in (r.block_ids or []))
    cached = {b.block_id for b in (pool.block_refs or []) if b.cached}
    in_use = reclaimable = free = 0
    for block in range(pool.num_blocks):
        if refs[block] > 0:
            in_use += 1
        elif block in cached:
            reclaimable += 1
        else:
            free += 1
    return Walked(in_use, reclaimable, free, sum(refs.values()), sum(1 for c in refs.values() if c >= 2))


@dataclass(frozen=True)
class Reserved:
    blocks: int
    growth_cap: int
    growth_estimate: int
    resident_tokens: int
    admission_headroom: int


def loop_reservations(
    pool: PoolFacts, requests: list[RequestFacts], max_model_len: int, sharing: str, walked: Walked
) -> Reserved:
    """docs/design.md §2 by a plain loop over the requests (admitted = running or preempted)."""
    b, c = pool.block_size, pool.num_blocks
    claimed = growth_cap = growth_estimate = running = computed = 0
    for r in requests:
        if r.state == "running":
            running += 1
            computed += r.computed_tokens
        if r.state not in ("running", "preempted"):
            continue
        reservation = design_reservation(r.prompt_tokens, r.max_output_tokens, b, max_model_len=max_model_len,
                                         n=max(1, r.contexts), k=r.speculative_slots, window=pool.sliding_window)
        held = len(r.block_ids or [])
        claimed += max(reservation, held)
        if r.output_bound == "estimate":
            growth_estimate += max(0, reservation - held)
        else:
            growth_cap += max(0, reservation - held)
    if sharing == "per-request":
        reserved, resident = claimed, computed
    else:
        reserved = walked.in_use + growth_cap + growth_estimate
        resident = computed - (walked.references - walked.in_use) * b
    headroom = min(max(0, c - reserved) // math.ceil(max_model_len / b), max(0, MAX_NUM_SEQS - running))
    return Reserved(reserved, growth_cap, growth_estimate, resident, headroom)


@settings(max_examples=300, deadline=None)
@given(ledgers(mixed_cache=True))
def test_physical_state_matches_a_block_by_block_walk(case: tuple[PoolFacts, list[RequestFacts], int]) -> None:
    pool, requests, L = case
    acc = account(pool, requests, L, "per-request")
    ph = acc.pools[0].physical
    walked = walk_pool(pool, requests)
    got = Walked(ph.in_use.exact, ph.reclaimable.exact, ph.free.exact, ph.references, ph.shared)  # type: ignore[union-attr,arg-type]
    assert got == walked
    assert ph.allocated.exact == walked.in_use + walked.reclaimable  # type: ignore[union-attr]
    assert acc.pools[0].physical_headroom_blocks.exact == walked.free + walked.reclaimable  # type: ignore[union-attr]
    assert acc.invariant_violations == []


@settings(max_examples=300, deadline=None)
@given(ledgers(mixed_cache=True), st.sampled_from(["per-request", "reference-aware"]))
def test_reservations_match_a_plain_loop_over_the_requests(
    case: tuple[PoolFacts, list[RequestFacts], int], sharing: str
) -> None:
    pool, requests, L = case
    acc = account(pool, requests, L, sharing).pools[0]
    want = loop_reservations(pool, requests, L, sharing, walk_pool(pool, requests))
    got = Reserved(
        acc.reserved_blocks.exact,  # type: ignore[union-attr,arg-type]
        acc.pending_growth_blocks["cap"],
        acc.pending_growth_blocks["estimate"],
        acc.resident_tokens.exact,  # type: ignore[union-attr,arg-type]
        acc.admission_headroom_requests.exact,  # type: ignore[union-attr,arg-type]
    )
    assert got == want
    assert acc.quota_headroom_blocks.exact == pool.num_blocks - want.blocks  # type: ignore[union-attr]


@settings(max_examples=300, deadline=None)
@given(ledgers())
def test_reference_aware_never_exceeds_per_request(case: tuple[PoolFacts, list[RequestFacts], int]) -> None:
    pool, requests, L = case
    per = account(pool, requests, L, "per-request").pools[0]
    ref = account(pool, requests, L, "reference-aware").pools[0]
    assert ref.reserved_blocks.exact <= per.reserved_blocks.exact  # type: ignore[union-attr,operator]
    assert ref.resident_tokens.exact <= per.resident_tokens.exact  # type: ignore[union-attr,operator]


@settings(max_examples=300, deadline=None)
@given(ledgers(all_caps=True))
def test_reserved_covers_in_use_when_bounds_are_caps(case: tuple[PoolFacts, list[RequestFacts], int]) -> None:
    pool, requests, L = case
    for sharing in ("per-request", "reference-aware"):
        acc = account(pool, requests, L, sharing).pools[0]
        assert acc.reserved_blocks.exact >= acc.physical.in_use.exact  # type: ignore[union-attr,operator]


@settings(max_examples=200, deadline=None)
@given(ledgers(), st.data())
def test_releasing_one_request_never_frees_blocks_others_reference(
    case: tuple[PoolFacts, list[RequestFacts], int], data: st.DataObject
) -> None:
    pool, requests, L = case
    holders = [r for r in requests if r.block_ids]
    if not holders:
        return
    gone = data.draw(st.sampled_from(holders))
    # release: dereference its blocks; cached blocks with no reference become reclaimable
    counts = {b.block_id: b.ref_count for b in pool.block_refs}  # type: ignore[union-attr]
    for bid in gone.block_ids:  # type: ignore[union-attr]
        counts[bid] -= 1
    after = PoolFacts(id="0", block_size=BLOCK, num_blocks=pool.num_blocks, block_bytes=64, sliding_window=pool.sliding_window,
                      block_refs=[BlockRef(b.block_id, counts[b.block_id], b.cached) for b in pool.block_refs])  # type: ignore[union-attr]
    rest = [r for r in requests if r is not gone]
    ph = account(after, rest, L, "per-request").pools[0].physical
    still_referenced = {b for r in rest for b in (r.block_ids or [])}
    in_use_after = {b.block_id for b in after.block_refs if b.ref_count > 0}  # type: ignore[union-attr]
    assert still_referenced <= in_use_after
    assert ph.in_use.exact == len(in_use_after)  # type: ignore[union-attr]
    # released blocks stay allocated (cached -> reclaimable), nothing vanishes
    before = account(pool, requests, L, "per-request").pools[0].physical
    assert ph.allocated.exact == before.allocated.exact  # type: ignore[union-attr]


@settings(max_examples=100, deadline=None)
@given(ledgers())
def test_columnar_block_refs_agree_with_objects(case: tuple[PoolFacts, list[RequestFacts], int]) -> None:
    from kvledger.domain.block_refs import BlockRefArray
    from kvledger.policy.physical import physical_from_block_refs

    pool, _, _ = case
    refs = list(pool.block_refs)  # type: ignore[arg-type]
    assert physical_from_block_refs(BlockRefArray.from_refs(refs), pool.num_blocks) == physical_from_block_refs(refs, pool.num_blocks)
