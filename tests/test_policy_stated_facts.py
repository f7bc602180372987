"""The policy's formulas for facts an engine states in aggregate (docs/design.md §2):

- ``unreferenced_blocks``: free and reclaimable together (TensorRT-LLM's free blocks include
  reusable cached blocks): physical headroom exact, free and reclaimable bounded above by it,
  allocated within [in_use, in_use + unreferenced], and in_use + unreferenced = capacity checked;
- ``reserved_blocks``: the engine's own reservation counted per request (TGI): exact under the
  per-request rule, an upper bound under reference-aware sharing.

Expected values are computed by hand from the facts, never by calling the code under test.
"""

from __future__ import annotations

import pytest
from accounting_support import accounts_of

from kvledger.domain.facts import Budgets, EngineFacts, PoolFacts, Snapshot
from kvledger.domain.measure import Measure


def account(pool: PoolFacts, sharing: str = "per-request", max_model_len: int | None = 1024, max_num_seqs: int | None = None):  # type: ignore[no-untyped-def]
    engine = EngineFacts(name="e", kind="x", source="x", pools=[pool],
                         budgets=Budgets(max_model_len=max_model_len, max_num_seqs=max_num_seqs))
    accounts = accounts_of(Snapshot(engines=[engine], sharing=sharing))  # type: ignore[arg-type]
    return accounts.engines[0]


def test_unreferenced_blocks_bound_free_and_reclaimable_and_fix_physical_headroom() -> None:
    e = account(PoolFacts(id="0", block_size=32, num_blocks=100, block_bytes=10, in_use=40, unreferenced_blocks=60))
    (p,) = e.pools
    assert e.invariant_violations == []
    assert p.physical.in_use == Measure(exact=40)
    # free and reclaimable each lie in [0, 60]: only the upper bound is stated
    assert p.physical.free == Measure(upper=60) and p.physical.reclaimable == Measure(upper=60)
    assert list(p.physical.reclaimable.series()) == [("upper_bound", 60)]  # type: ignore[union-attr]
    # allocated = in_use + reclaimable lies in [40, 100]
    assert p.physical.allocated == Measure(lower=40, upper=100)
    # physical headroom = free + reclaimable = 100 - 40, exactly
    assert p.physical_headroom_blocks == Measure(exact=60)
    assert p.bytes_of(p.physical_headroom_blocks) == Measure(exact=600)


def test_no_unreferenced_block_means_free_and_reclaimable_are_exactly_zero() -> None:
    (p,) = account(PoolFacts(id="0", block_size=32, num_blocks=100, in_use=100, unreferenced_blocks=0)).pools
    assert p.physical.free == Measure(exact=0) and p.physical.reclaimable == Measure(exact=0)
    assert p.physical.allocated == Measure(exact=100)


@pytest.mark.parametrize(("in_use", "unreferenced"), [(40, 50), (70, 60), (101, 0)])
def test_unreferenced_partition_violated_leaves_the_physical_state_unknown(in_use: int, unreferenced: int) -> None:
    e = account(PoolFacts(id="0", block_size=32, num_blocks=100, in_use=in_use, unreferenced_blocks=unreferenced))
    (p,) = e.pools
    assert "unreferenced_partition" in e.invariant_violations
    assert p.physical.in_use is None and p.physical.free is None and p.physical.reclaimable is None
    assert p.physical.allocated is None and p.physical_headroom_blocks is None


def test_stated_reservation_is_exact_per_request() -> None:
    (p,) = account(PoolFacts(id="0", block_size=16, num_blocks=200, block_bytes=8, reserved_blocks=150,
                             running_requests=4), max_num_seqs=10).pools
    assert p.reserved_blocks == Measure(exact=150)
    assert p.quota_headroom_blocks == Measure(exact=50)
    # 50 free quota blocks / ceil(1024 / 16) = 64 per request -> 0; seats 10 - 4 = 6 -> min 0
    assert p.admission_headroom_requests == Measure(exact=0)
    # nothing physical is stated: no in-use, allocated, reclaimable or physical headroom
    assert p.physical.in_use is None and p.physical.allocated is None and p.physical_headroom_blocks is None


def test_stated_reservation_above_capacity_is_kept_as_the_broken_promise() -> None:
    (p,) = account(PoolFacts(id="0", block_size=16, num_blocks=200, reserved_blocks=230)).pools
    assert p.reserved_blocks == Measure(exact=230) and p.quota_headroom_blocks == Measure(exact=-30)


def test_stated_reservation_bounds_the_reference_aware_rule() -> None:
    (p,) = account(PoolFacts(id="0", block_size=16, num_blocks=200, reserved_blocks=150), sharing="reference-aware").pools
    assert p.reserved_blocks == Measure(upper=150)
    assert p.quota_headroom_blocks == Measure(lower=50)
    (q,) = account(PoolFacts(id="0", block_size=16, num_blocks=200, reserved_blocks=150, in_use=90),
                   sharing="reference-aware").pools
    assert q.reserved_blocks == Measure(lower=90, upper=150)


def test_stated_reservation_wins_over_the_running_count_bound() -> None:
    # without it, 4 running x ceil(1024 / 16) = 256 would be the upper bound
    (p,) = account(PoolFacts(id="0", block_size=16, num_blocks=300, reserved_blocks=120, running_requests=4)).pools
    assert p.reserved_blocks == Measure(exact=120)
    (q,) = account(PoolFacts(id="0", block_size=16, num_blocks=300, running_requests=4)).pools
    assert q.reserved_blocks == Measure(upper=256)


def test_utilization_ratios_share_one_meaning_across_engines() -> None:
    # TensorRT-LLM-like: in-use exact -> physical exact; reservations bounded -> quota bounded
    (p,) = account(PoolFacts(id="0", block_size=32, num_blocks=100, in_use=40, unreferenced_blocks=60,
                             running_requests=3)).pools
    assert p.physical_utilization == Measure(exact=0.4)
    assert p.quota_utilization == Measure(upper=3 * 32 / 100)  # 3 x ceil(1024 / 32) = 96 blocks
    # TGI-like: no physical state, the reservation exact (may exceed 1: a broken promise)
    (q,) = account(PoolFacts(id="0", block_size=16, num_blocks=200, reserved_blocks=250)).pools
    assert q.physical_utilization is None and q.quota_utilization == Measure(exact=1.25)
