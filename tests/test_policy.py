"""The policy against hand computation (each formula of docs/design.md §2)."""

from __future__ import annotations

import pytest
from accounting_support import accounts_of

from kvledger.domain.facts import (
    BlockRef,
    Budgets,
    EngineFacts,
    GpuFacts,
    MemoryTerm,
    PoolFacts,
    RequestFacts,
    Snapshot,
    TenantQuota,
)
from kvledger.domain.measure import Measure
from kvledger.policy.engine_accounts import admission_headroom, engine_account
from kvledger.policy.physical import physical_state
from kvledger.policy.reservations import reservation_blocks


def req(rid: str, state: str = "running", p: int = 100, o: int = 50, **kw: object) -> RequestFacts:
    return RequestFacts(id=rid, state=state, prompt_tokens=p, max_output_tokens=o, **kw)  # type: ignore[arg-type]


def engine(pool: PoolFacts, requests: list[RequestFacts] | None, **kw: object) -> EngineFacts:
    budgets = kw.pop("budgets", Budgets(max_model_len=4096, max_num_seqs=8))
    return EngineFacts(name="e", kind="ledger", source="ledger", pools=[pool], requests=requests, budgets=budgets, **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------- R(r)


def test_reservation_plain() -> None:
    # P=100, O=50, B=16: ceil(150/16) = 10
    assert reservation_blocks(100, 50, 16, max_model_len=None) == 10


def test_reservation_capped_by_max_model_len() -> None:
    # min(100+5000, 1024) = 1024 -> 64 blocks of 16
    assert reservation_blocks(100, 5000, 16, max_model_len=1024) == 64


def test_reservation_speculative_slots() -> None:
    # P+O+k = 100+50+4 = 154 -> ceil(154/16) = 10; with k=11: 161 -> 11
    assert reservation_blocks(100, 50, 16, max_model_len=None, speculative_slots=4) == 10
    assert reservation_blocks(100, 50, 16, max_model_len=None, speculative_slots=11) == 11


def test_reservation_extra_contexts_share_full_prompt_blocks() -> None:
    # T = ceil(150/16) = 10, floor(100/16) = 6 shared full prompt blocks;
    # each extra branch copies the partial block and grows alone: 10 - 6 = 4 blocks each.
    # n=3: 10 + 2*4 = 18
    assert reservation_blocks(100, 50, 16, max_model_len=None, contexts=3) == 18


def test_reservation_prompt_on_block_boundary() -> None:
    # P=96 (6 full blocks), O=32: T = 8; n=2: 8 + (8-6) = 10
    assert reservation_blocks(96, 32, 16, max_model_len=None, contexts=2) == 10


def test_reservation_sliding_window() -> None:
    # T = ceil(5000/16) = 313; window 1024 -> ceil(1024/16)+1 = 65 blocks per context
    assert reservation_blocks(4000, 1000, 16, max_model_len=None, sliding_window=1024) == 65
    # two contexts: min(313 + (313-250), 2*65) = 130
    assert reservation_blocks(4000, 1000, 16, max_model_len=None, contexts=2, sliding_window=1024) == 130
    # a short request under the window is unaffected
    assert reservation_blocks(100, 50, 16, max_model_len=None, sliding_window=1024) == 10


# ---------------------------------------------------------------- sharing rules


def _shared_prefix_case() -> tuple[PoolFacts, list[RequestFacts]]:
    # Two running requests share 4 prefix blocks; each holds 2 private blocks.
    # refs: blocks 0-3 refcount 2; 4,5 (r1) and 6,7 (r2) refcount 1; 8,9 cached & unreferenced.
    refs = [BlockRef(i, 2, True) for i in range(4)] + [BlockRef(i, 1, i < 6) for i in range(4, 8)]
    refs += [BlockRef(8, 0, True), BlockRef(9, 0, True)]
    pool = PoolFacts(id="0", block_size=16, num_blocks=40, block_bytes=1000, block_refs=refs)
    r1 = req("r1", p=64, o=64, blocks_held=6, computed_tokens=90, block_ids=[0, 1, 2, 3, 4, 5])
    r2 = req("r2", p=64, o=16, blocks_held=6, computed_tokens=85, block_ids=[0, 1, 2, 3, 6, 7])
    return pool, [r1, r2]


def test_physical_from_block_refs() -> None:
    pool, _ = _shared_prefix_case()
    ph = physical_state(pool)
    assert (ph.in_use, ph.reclaimable, ph.allocated, ph.free) == (
        Measure(exact=8), Measure(exact=2), Measure(exact=10), Measure(exact=30))
    assert ph.references == 12 and ph.shared == 4


def test_per_request_reserved() -> None:
    pool, reqs = _shared_prefix_case()
    acc = engine_account(engine(pool, reqs), "per-request").pools[0]
    # r1: R = ceil(128/16) = 8, held 6 -> 8; r2: R = ceil(80/16) = 5, held 6 -> 6; sum 14
    assert acc.reserved_blocks == Measure(exact=14)
    assert acc.bytes_of(acc.reserved_blocks) == Measure(exact=14000)
    # pending growth: r1 8-6 = 2, r2 max(0, 5-6) = 0
    assert acc.pending_growth_blocks == {"cap": 2, "estimate": 0}
    # resident tokens, per-request: 90 + 85
    assert acc.resident_tokens == Measure(exact=175)


def test_reference_aware_reserved() -> None:
    pool, reqs = _shared_prefix_case()
    acc = engine_account(engine(pool, reqs), "reference-aware").pools[0]
    # in_use 8 + pending growth 2 = 10
    assert acc.reserved_blocks == Measure(exact=10)
    # resident tokens: 175 - (references 12 - in_use 8) * 16 = 111
    assert acc.resident_tokens == Measure(exact=111)


def test_waiting_requests_reserve_nothing_preempted_do() -> None:
    pool = PoolFacts(id="0", block_size=16, num_blocks=100, block_bytes=10, in_use=0, reclaimable=0, free=100)
    reqs = [req("w", state="waiting"), req("p", state="preempted", blocks_held=0)]
    acc = engine_account(engine(pool, reqs), "per-request").pools[0]
    assert acc.reserved_blocks == Measure(exact=10)  # only the preempted request's R = 10


def test_estimate_growth_labelled_as_estimate() -> None:
    pool = PoolFacts(id="0", block_size=16, num_blocks=100, block_bytes=10, in_use=3, reclaimable=0, free=97)
    reqs = [req("a", p=32, o=64, output_bound="estimate", blocks_held=3),
            req("b", p=32, o=32, output_bound="cap", blocks_held=2)]
    acc = engine_account(engine(pool, reqs), "per-request").pools[0]
    # a: R=6, held 3 -> 3 estimate; b: R=4, held 2 -> 2 cap
    assert acc.pending_growth_blocks == {"cap": 2, "estimate": 3}


def test_estimate_overflow_holds_more_than_reserved() -> None:
    # a request that exceeded its estimate holds more than R: counted as held, no negative growth
    pool = PoolFacts(id="0", block_size=16, num_blocks=100, block_bytes=10, in_use=9, reclaimable=0, free=91)
    reqs = [req("a", p=32, o=32, output_bound="estimate", blocks_held=9, computed_tokens=140)]
    acc = engine_account(engine(pool, reqs), "per-request").pools[0]
    assert acc.reserved_blocks == Measure(exact=9)
    assert acc.pending_growth_blocks["estimate"] == 0
    ref = engine_account(engine(pool, reqs), "reference-aware").pools[0]
    assert ref.reserved_blocks == Measure(exact=9)


# ---------------------------------------------------------------- headroom


def test_quota_and_physical_headroom_are_different_numbers() -> None:
    pool = PoolFacts(id="0", block_size=16, num_blocks=20, block_bytes=100, in_use=5, reclaimable=10, free=5)
    reqs = [req("a", p=160, o=160, blocks_held=5)]  # R = 20
    acc = engine_account(engine(pool, reqs), "per-request").pools[0]
    assert acc.quota_headroom_blocks == Measure(exact=0)  # 20 - 20
    assert acc.physical_headroom_blocks == Measure(exact=15)  # free 5 + reclaimable 10


def test_overcommit_gives_negative_quota_headroom() -> None:
    pool = PoolFacts(id="0", block_size=16, num_blocks=10, block_bytes=100, in_use=4, reclaimable=0, free=6)
    reqs = [req("a", p=160, o=0, blocks_held=2), req("b", p=160, o=0, blocks_held=2)]  # R=10 each
    acc = engine_account(engine(pool, reqs), "per-request").pools[0]
    assert acc.quota_headroom_blocks == Measure(exact=-10)


def test_admission_headroom() -> None:
    # C=1000, reserved 200, ceil(L/B) = ceil(4096/16) = 256 -> floor(800/256) = 3; seqs 8-2 = 6 -> 3
    assert admission_headroom(Measure(exact=200), 1000, 16, 4096, 8, 2) == Measure(exact=3)
    # the work budget binds: max_num_seqs 4, running 3 -> 1
    assert admission_headroom(Measure(exact=0), 1000, 16, 4096, 4, 3) == Measure(exact=1)
    # over quota: max(0, C - reserved) = 0
    assert admission_headroom(Measure(exact=1200), 1000, 16, 4096, 8, 2) == Measure(exact=0)
    # an upper bound on reserved gives a lower bound on headroom
    assert admission_headroom(Measure(upper=200), 1000, 16, 4096, 8, 2) == Measure(lower=3)


# ---------------------------------------------------------------- bounds from /metrics + events


def test_upper_bound_from_running_count() -> None:
    pool = PoolFacts(id="0", block_size=32, num_blocks=127, block_bytes=16384, in_use=40, running_requests=3)
    acc = engine_account(engine(pool, None, budgets=Budgets(max_model_len=1024)), "per-request").pools[0]
    # 3 x ceil(1024/32) = 96 blocks, basis upper_bound
    assert acc.reserved_blocks == Measure(upper=96)
    assert list(acc.bytes_of(acc.reserved_blocks).series()) == [("upper_bound", 96 * 16384)]  # type: ignore[union-attr]
    # quota headroom is then a lower bound
    assert acc.quota_headroom_blocks == Measure(lower=127 - 96)


def test_reclaimable_bounds_from_cached_count() -> None:
    # U=10 in use, H=17 cached, C=127: reclaimable in [max(0,17-10), min(17, 117)] = [7, 17]
    pool = PoolFacts(id="0", block_size=32, num_blocks=127, in_use=10, cached_blocks=17)
    ph = physical_state(pool)
    assert ph.reclaimable == Measure(lower=7, upper=17)
    assert ph.allocated == Measure(lower=17, upper=27)
    assert ph.free == Measure(lower=100, upper=110)
    # idle server with a full prefix cache: U=0 -> every cached block is reclaimable
    idle = physical_state(PoolFacts(id="0", block_size=32, num_blocks=127, in_use=0, cached_blocks=17))
    assert idle.reclaimable == Measure(exact=17)


def test_unknown_quantities_are_absent() -> None:
    pool = PoolFacts(id="0", block_size=16, num_blocks=100)
    acc = engine_account(engine(pool, None, budgets=Budgets()), "per-request").pools[0]
    assert acc.reserved_blocks is None and acc.physical.reclaimable is None and acc.capacity_bytes is None
    assert acc.resident_tokens is None and acc.admission_headroom_requests is None


# ---------------------------------------------------------------- tenants, GPU budget


def test_tenants_use_per_request_rule_under_both_sharings() -> None:
    pool, reqs = _shared_prefix_case()
    reqs[0].tenant = "a"
    reqs[1].tenant = "a"
    e = engine(pool, reqs, tenants=[TenantQuota("a", 50_000), TenantQuota("b", 1)])
    for sharing in ("per-request", "reference-aware"):
        tenants = {t.tenant: t for t in engine_account(e, sharing).tenants}
        assert tenants["a"].reserved_bytes == 14_000  # 8 + 6 blocks x 1000
        assert tenants["b"].reserved_bytes == 0
        assert tenants["a"].requests["running"] == 2


def test_gpu_unaccounted_and_missing_terms() -> None:
    pool = PoolFacts(id="0", block_size=16, num_blocks=100, block_bytes=1_000_000)  # kv_pool 100 MB
    e1 = engine(pool, [], gpus=[0, 1], memory=[
        MemoryTerm(0, "weights", 500_000_000, "measured"), MemoryTerm(1, "weights", 500_000_000, "measured"),
        MemoryTerm(0, "workspace", 10_000_000, "measured"), MemoryTerm(1, "workspace", 10_000_000, "measured"),
        MemoryTerm(0, "runtime_buffers", 5_000_000, "measured"), MemoryTerm(1, "runtime_buffers", 5_000_000, "measured"),
        MemoryTerm(0, "reserve", 1_000_000_000, "configured"),
    ])
    gpus = [GpuFacts(0, True, total_bytes=10**10, used_bytes=600_000_000, driver_reserved_bytes=5), GpuFacts(1, True, total_bytes=10**10, used_bytes=570_000_000, driver_reserved_bytes=5),
            GpuFacts(2, True, total_bytes=10**10, used_bytes=1)]
    acc = accounts_of(Snapshot(engines=[e1], gpus=gpus))
    by_gpu = {g.facts.index: g.unaccounted for g in acc.gpus}
    # TP across 2 GPUs: kv_pool 100 MB split 50 MB each; declared 500+10+5+50 = 565 MB (reserve excluded)
    assert by_gpu[0] == Measure(exact=600_000_000 - 565_000_000)
    assert by_gpu[1] == Measure(exact=5_000_000)
    assert by_gpu[2] is None  # no engine on GPU 2: nothing declared, absent
    # the inequality: 10 GB - (500 + 10 + 5 + 50 + 1000 reserve) MB on GPU 0
    assert {g.facts.index: g.budget_slack for g in acc.gpus} == {0: 10**10 - 1_565_000_000, 1: 10**10 - 565_000_000, 2: None}
    kv = [t for t in acc.budget if t.category == "kv_pool"]
    assert {(t.gpu, t.bytes) for t in kv} == {(0, 50_000_000), (1, 50_000_000)}


def test_gpu_unaccounted_absent_without_weights_and_bound_without_workspace() -> None:
    pool = PoolFacts(id="0", block_size=16, num_blocks=100, block_bytes=1_000_000)
    gpu = [GpuFacts(0, True, total_bytes=10**10, used_bytes=300_000_000, driver_reserved_bytes=0)]
    no_weights = engine(pool, [], gpus=[0])
    assert accounts_of(Snapshot(engines=[no_weights], gpus=gpu)).gpus[0].unaccounted is None
    partial = engine(pool, [], gpus=[0], memory=[MemoryTerm(0, "weights", 100_000_000, "measured")])
    # workspace and runtime buffers undeclared: what is left over is at most 300-100-100
    assert accounts_of(Snapshot(engines=[partial], gpus=gpu)).gpus[0].unaccounted == Measure(upper=100_000_000)


def test_several_engines_on_one_gpu() -> None:
    p = PoolFacts(id="0", block_size=16, num_blocks=10, block_bytes=1_000)
    terms = [MemoryTerm(0, c, 1_000, "configured") for c in ("weights", "workspace", "runtime_buffers")]
    a = EngineFacts(name="a", kind="ledger", source="ledger", pools=[p], gpus=[0], memory=terms)
    b = EngineFacts(name="b", kind="ledger", source="ledger", pools=[p], gpus=[0], memory=terms)
    acc = accounts_of(Snapshot(engines=[a, b], gpus=[GpuFacts(0, True, used_bytes=30_000, driver_reserved_bytes=0)]))
    # each engine declares 3 x 1000 + kv 10 x 1000 = 13,000
    assert acc.gpus[0].unaccounted == Measure(exact=30_000 - 26_000)


@pytest.mark.parametrize(
    ("pool", "check"),
    [
        (PoolFacts(id="0", block_size=16, num_blocks=10, in_use=5, references=4), "references_ge_in_use"),
        (PoolFacts(id="0", block_size=16, num_blocks=10, in_use=2, shared=3, references=9), "in_use_ge_shared"),
        (PoolFacts(id="0", block_size=16, num_blocks=10, in_use=2, reclaimable=2, free=2), "partition"),
        (PoolFacts(id="0", block_size=16, num_blocks=10, in_use=2, block_refs=[BlockRef(1, 1, True)]), "summary_in_use"),
    ],
)
def test_invariant_violations_named(pool: PoolFacts, check: str) -> None:
    assert check in engine_account(engine(pool, None), "per-request").invariant_violations


def test_consistent_pool_has_no_violations() -> None:
    pool, reqs = _shared_prefix_case()
    pool.in_use, pool.reclaimable, pool.free, pool.references, pool.shared = 8, 2, 30, 12, 4
    assert engine_account(engine(pool, reqs), "per-request").invariant_violations == []


def test_unaccounted_is_an_upper_bound_with_memory_v1() -> None:
    # v1 "used" includes driver-reserved memory: what is left over is at most this
    p = PoolFacts(id="0", block_size=16, num_blocks=10, block_bytes=1_000)
    terms = [MemoryTerm(0, c, 1_000, "configured") for c in ("weights", "workspace", "runtime_buffers")]
    a = EngineFacts(name="a", kind="ledger", source="ledger", pools=[p], gpus=[0], memory=terms)
    acc = accounts_of(Snapshot(engines=[a], gpus=[GpuFacts(0, True, used_bytes=20_000, driver_reserved_bytes=None)]))
    assert acc.gpus[0].unaccounted == Measure(upper=7_000)


@pytest.mark.parametrize(
    ("pool", "check"),
    [
        (PoolFacts(id="0", block_size=16, num_blocks=10, block_bytes=100, in_use=2, reclaimable=2, free=2), "partition"),
        (PoolFacts(id="0", block_size=16, num_blocks=10, block_bytes=100, in_use=12, free=0), "in_use_le_capacity"),
        (PoolFacts(id="0", block_size=16, num_blocks=10, block_bytes=100, in_use=6, reclaimable=6), "allocated_le_capacity"),
    ],
)
def test_impossible_physical_state_is_counted_and_left_unknown(pool: PoolFacts, check: str) -> None:
    acc = engine_account(engine(pool, None), "reference-aware")
    assert check in acc.invariant_violations
    phys = acc.pools[0].physical
    assert phys.in_use is None and phys.reclaimable is None and phys.allocated is None and phys.free is None
    assert acc.pools[0].physical_headroom_blocks is None and acc.pools[0].capacity_bytes == 1000  # capacity stays known


@pytest.mark.parametrize("claim", [-1.0, 10.5, 190.0])
def test_engine_claim_outside_capacity_is_counted_and_not_exported(claim: float) -> None:
    pool = PoolFacts(id="0", block_size=16, num_blocks=10, in_use=3, engine_reported_used_blocks=claim)
    acc = engine_account(engine(pool, None), "per-request")
    assert acc.invariant_violations == ["engine_reported_used_in_range"]
    assert acc.pools[0].engine_reported_used_blocks is None
    assert acc.pools[0].physical.in_use == Measure(exact=3)  # the other facts stay


def test_source_reported_violations_are_counted() -> None:
    pool = PoolFacts(id="0", block_size=16, num_blocks=10, source_violations=("kv_cache_usage_in_range",))
    assert engine_account(engine(pool, None), "per-request").invariant_violations == ["kv_cache_usage_in_range"]


# ---------------------------------------------------------------- the engine's own reservation


@pytest.mark.parametrize("sharing", ["per-request", "reference-aware"])
def test_engine_reservation_without_sharing_is_exact_and_wins_over_the_running_bound(sharing: str) -> None:
    """PoolFacts.reserved_blocks with no block shared (shared=0, e.g. llama.cpp's busy split
    slots x their context): the two sharing rules agree, so it is exact under both, before
    the running x ceil(L/B) bound."""
    pool = PoolFacts(id="0", block_size=1, num_blocks=8192, block_bytes=256, in_use=700, reclaimable=300,
                     shared=0, running_requests=3, reserved_blocks=3 * 2048)
    acc = engine_account(engine(pool, None, budgets=Budgets(max_model_len=2048, max_num_seqs=4)), sharing)
    (p,) = acc.pools
    assert p.reserved_blocks == Measure(exact=6144)
    assert p.quota_headroom_blocks == Measure(exact=8192 - 6144)
    # min(floor((8192 - 6144) / 2048), 4 - 3) = 1 idle slot
    assert p.admission_headroom_requests == Measure(exact=1)
    assert acc.invariant_violations == []


@pytest.mark.parametrize("shared", [None, 5])
def test_engine_reservation_with_possible_sharing_bounds_the_reference_aware_rule(shared: int | None) -> None:
    """Sharing unknown or present: resident blocks count once under reference-aware, so the
    stated reservation (each request counted alone) is an upper bound and in-use a lower one."""
    pool = PoolFacts(id="0", block_size=1, num_blocks=8192, in_use=700, reclaimable=300, shared=shared,
                     running_requests=3, reserved_blocks=6144)
    (p,) = engine_account(engine(pool, None, budgets=Budgets(max_model_len=2048)), "reference-aware").pools
    assert p.reserved_blocks == Measure(lower=700, upper=6144)
    (q,) = engine_account(engine(pool, None, budgets=Budgets(max_model_len=2048)), "per-request").pools
    assert q.reserved_blocks == Measure(exact=6144)


def test_engine_reservation_below_in_use_is_counted_and_dropped() -> None:
    pool = PoolFacts(id="0", block_size=1, num_blocks=8192, in_use=700, reclaimable=0, running_requests=1,
                     reserved_blocks=699)
    acc = engine_account(engine(pool, None, budgets=Budgets(max_model_len=2048)), "per-request")
    assert acc.invariant_violations == ["engine_reserved_ge_in_use"]
    # what the running count bounds remains: max(1 x 2048, in_use)
    assert acc.pools[0].reserved_blocks == Measure(upper=2048)
    assert acc.pools[0].physical.in_use == Measure(exact=700)
