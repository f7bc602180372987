"""Property-based tests of the policy's invariants on random ledgers (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.model import BlockRef, Budgets, EngineFacts, PoolFacts, RequestFacts
from kvledger.policy import engine_account, reservation_blocks

BLOCK = 16


@st.composite
def ledgers(draw: st.DrawFn, all_caps: bool = False) -> tuple[PoolFacts, list[RequestFacts], int]:
    """A random consistent ledger: requests referencing blocks (some shared), cached blocks."""
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
            r = reservation_blocks(p, o, BLOCK, max_model_len=max_model_len, contexts=n, speculative_slots=k, sliding_window=window)
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
    refs = [BlockRef(b, refcount.get(b, 0), True) for b in range(min(next_block, capacity)) if refcount.get(b, 0) or b < n_prefix]
    n_cached = draw(st.integers(min_value=0, max_value=max(0, capacity - next_block)))
    refs += [BlockRef(b, 0, True) for b in range(next_block, next_block + n_cached)]
    pool = PoolFacts(id="0", block_size=BLOCK, num_blocks=capacity, block_bytes=64, sliding_window=window, block_refs=refs)
    return pool, requests, max_model_len


def account(pool: PoolFacts, requests: list[RequestFacts], max_model_len: int, sharing: str):  # type: ignore[no-untyped-def]
    e = EngineFacts(name="e", kind="ledger", source="ledger", pools=[pool], requests=requests,
                    budgets=Budgets(max_model_len=max_model_len, max_num_seqs=16))
    return engine_account(e, sharing)


@settings(max_examples=300, deadline=None)
@given(ledgers())
def test_physical_invariants(case: tuple[PoolFacts, list[RequestFacts], int]) -> None:
    pool, requests, L = case
    ph = account(pool, requests, L, "per-request").pools[0].physical
    c = pool.num_blocks
    in_use, rec, alloc, free = (m.exact for m in (ph.in_use, ph.reclaimable, ph.allocated, ph.free))  # type: ignore[union-attr]
    assert in_use + rec + free == c  # the partition sums to capacity
    assert ph.references >= in_use >= ph.shared  # type: ignore[operator]
    assert rec <= alloc <= c  # type: ignore[operator]
    assert account(pool, requests, L, "per-request").invariant_violations == []


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
    from kvledger.blockrefs import BlockRefArray
    from kvledger.policy import physical_from_block_refs

    pool, _, _ = case
    refs = list(pool.block_refs)  # type: ignore[arg-type]
    assert physical_from_block_refs(BlockRefArray.from_refs(refs), pool.num_blocks) == physical_from_block_refs(refs, pool.num_blocks)
