"""SGLang /metrics -> EngineFacts: goldens per fixture, hand-computed facts and bases, and the
errors and violations for bad values.

Regenerate the goldens (read the diff): see tests/engine_golden.py.
"""

from __future__ import annotations

import re

import pytest
from accounting_support import accounts_of
from engine_golden import FIXTURES, check_golden

from kvledger.collect.merge import configured_facts, merge
from kvledger.collect.sources.base import SourceError
from kvledger.collect.sources.sglang.metrics import PAGE_CHECK, SUM_CHECK, USED_CHECK, sglang_facts
from kvledger.collect.sources.sglang.source import page_size_from_server_info
from kvledger.config.types import EngineConfig
from kvledger.domain.facts import Snapshot
from kvledger.domain.measure import Measure

DIR = FIXTURES / "sglang"
OLD = (DIR / "sglang-before-kv-gauges-tp2-metrics.txt").read_text()
NEW = (DIR / "sglang-kv-gauges-metrics.txt").read_text()
HYBRID = (DIR / "sglang-kv-gauges-hybrid-dp2-metrics.txt").read_text()


def cfg(**kw) -> EngineConfig:  # type: ignore[no-untyped-def]
    base = dict(name="sg", kind="sglang", url="http://127.0.0.1:30000/metrics", max_model_len=8192)
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


CASES = {
    "sglang-before-kv-gauges-tp2-metrics": cfg(block_bytes=131072),
    "sglang-kv-gauges-metrics": cfg(block_bytes=2 << 20),
    "sglang-kv-gauges-hybrid-dp2-metrics": cfg(),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name: str) -> None:
    check_golden(sglang_facts((DIR / f"{name}.txt").read_text(), CASES[name]), DIR / "golden" / f"{name}.json")


def accounts(facts, sharing: str = "per-request"):  # type: ignore[no-untyped-def]
    engine = merge(facts, configured_facts(cfg()))
    return accounts_of(Snapshot(engines=[engine], sharing=sharing)).engines[0]  # type: ignore[arg-type]


def test_kv_gauges_give_the_exact_partition_in_pages() -> None:
    facts = sglang_facts(NEW, cfg(block_bytes=2 << 20))
    (pool,) = facts.pools  # the zero swa/mamba triples of a plain model are no pools
    # 262144 tokens in pages of 16; available 131072, evictable 81920, used 49152 tokens
    assert (pool.id, pool.block_size, pool.num_blocks) == ("0", 16, 16384)
    assert (pool.free, pool.reclaimable, pool.in_use) == (8192, 5120, 3072)
    assert pool.engine_reported_used_blocks == 3072.0 and pool.source_violations == ()
    assert pool.running_requests == 21  # the priority="" total, not the per-priority series
    assert facts.request_counts is not None
    assert (facts.request_counts.running, facts.request_counts.waiting, facts.request_counts.preempted) == (21, 4, None)
    assert facts.budgets.max_model_len == 131072  # sglang:context_len
    # realtime tokens: queried = prefill_cache + prefill_compute, hit = prefill_cache; cache_hit_rate ignored
    assert facts.counters == {"preemptions": 17.0, "prefix_cache_queried_tokens": 8388608.0,
                              "prefix_cache_hit_tokens": 5242880.0, "host_offloaded_tokens": 2211840.0,
                              "host_loaded_tokens": 614400.0}
    (p,) = accounts(facts).pools
    for m, blocks in ((p.physical.in_use, 3072), (p.physical.reclaimable, 5120), (p.physical.free, 8192),
                      (p.physical.allocated, 3072 + 5120)):
        assert m == Measure(exact=blocks)
    assert p.physical_headroom_blocks == Measure(exact=16384 - 3072)
    # 21 running x ceil(131072 / 16) pages: an upper bound on reservations (dynamic admission)
    assert p.reserved_blocks == Measure(upper=21 * 8192)


def test_older_builds_know_in_use_exactly_and_free_plus_reclaimable_only_together() -> None:
    facts = sglang_facts(OLD, cfg(block_bytes=131072))
    (pool,) = facts.pools
    # page size 1 (SGLang's default, no sglang:page_size); TP ranks 0 and 1 report the same pool once
    assert (pool.block_size, pool.num_blocks, pool.in_use, pool.unreferenced_blocks) == (1, 241066, 48213, 192853)
    assert pool.reclaimable is None and pool.free is None
    assert facts.request_counts is not None and facts.request_counts.running == 12  # not 24
    # realtime tokens of one TP rank, not both
    assert facts.counters["prefix_cache_queried_tokens"] == 2_000_000.0 and facts.counters["preemptions"] == 5.0
    (p,) = accounts(facts).pools
    assert p.physical.in_use == Measure(exact=48213)
    assert p.physical.reclaimable == Measure(upper=192853) and p.physical.free == Measure(upper=192853)
    assert p.physical_headroom_blocks == Measure(exact=192853)
    names = {basis for basis, _ in p.physical.reclaimable.series()}  # type: ignore[union-attr]
    assert names == {"upper_bound"}  # never a reclaimable of zero


def test_hybrid_pools_stay_apart_per_dp_rank() -> None:
    facts = sglang_facts(HYBRID, cfg())
    got = {p.id: (p.block_size, p.num_blocks, p.in_use, p.reclaimable, p.free) for p in facts.pools}
    assert got == {
        "0": (32, 2048, 512, 512, 1024),
        "0/swa": (32, 512, 128, 128, 256),  # 16384 tokens of the SWA pool in pages of 32
        "0/mamba": (1, 64, 16, 8, 40),  # state slots
        "1": (32, 2048, 128, 0, 1920),
        "1/swa": (32, 512, 32, 0, 480),
        "1/mamba": (1, 64, 8, 0, 56),
    }
    assert [p.running_requests for p in facts.pools if "/" not in p.id] == [9, 2]
    assert facts.counters["preemptions"] == 4.0


def test_server_info_page_size_used_when_metrics_has_none() -> None:
    facts = sglang_facts(OLD.replace("241066.0", "241072.0").replace("48213.0", "48224.0"), cfg(), page_size=16)
    (pool,) = facts.pools
    # 241072 tokens = 15067 pages of 16; 48224 used tokens; 192848 unused = 12053 pages
    assert (pool.block_size, pool.num_blocks, pool.unreferenced_blocks, pool.in_use) == (16, 15067, 12053, 3014)
    assert page_size_from_server_info('{"page_size": 64, "tp_size": 2}', "x") == 64
    assert page_size_from_server_info('{"page_size": null}', "x") == 1
    for bad, reason in (("[1]", "schema"), ('{"page_size": 0}', "schema"), ('{"page_size": "16"}', "schema"),
                        ("{", "parse")):
        with pytest.raises(SourceError) as err:
            page_size_from_server_info(bad, "http://h/get_server_info")
        assert err.value.reason == reason and "http://h/get_server_info" in str(err.value)


def _set(text: str, metric: str, value: str) -> str:
    """Every sample of ``metric`` set to ``value``."""
    pattern = rf"^({re.escape(metric)}\{{[^}}]*\}}) \S+$"
    out, n = re.subn(pattern, rf"\g<1> {value}", text, flags=re.MULTILINE)
    assert n, metric
    return out


def test_triple_not_adding_up_to_capacity_is_a_violation_not_a_number() -> None:
    facts = sglang_facts(_set(NEW, "sglang:kv_evictable_tokens", "90000.0"), cfg())
    (pool,) = facts.pools
    assert pool.source_violations == (SUM_CHECK, PAGE_CHECK) or pool.source_violations == (SUM_CHECK,)
    assert pool.in_use is None and pool.free is None and pool.reclaimable is None
    e = accounts(facts)
    assert SUM_CHECK in e.invariant_violations and e.pools[0].physical.in_use is None


def test_tokens_not_in_whole_pages_are_a_violation() -> None:
    text = _set(_set(NEW, "sglang:kv_available_tokens", "131071.0"), "sglang:kv_used_tokens", "49153.0")
    (pool,) = sglang_facts(text, cfg()).pools
    assert pool.source_violations == (PAGE_CHECK,) and pool.in_use is None


def test_old_build_used_above_capacity_is_a_violation() -> None:
    text = OLD.replace("} 48213.0", "} 300000.0")
    (pool,) = sglang_facts(text, cfg()).pools
    assert pool.source_violations == (USED_CHECK,) and pool.in_use is None and pool.unreferenced_blocks is None


def test_old_build_hybrid_swa_num_used_is_not_the_full_pools() -> None:
    text = OLD.replace('sglang:swa_token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct",engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0"} 0.0',
                       'sglang:swa_token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct",engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0"} 0.7')
    (pool,) = sglang_facts(text, cfg()).pools
    assert pool.in_use is None and pool.unreferenced_blocks is None and pool.source_violations == ()


@pytest.mark.parametrize(("metric", "value", "problem"), [
    ("sglang:kv_used_tokens", "NaN", "is not finite"),
    ("sglang:kv_available_tokens", "-16", "is negative"),
    ("sglang:num_running_reqs", "2.5", "is not a whole number of requests"),
    ("sglang:max_total_num_tokens", "1e300", "exceeds"),
    ("sglang:num_retracted_requests_total", "+Inf", "is not finite"),
    ("sglang:page_size", "0", "is not a number of tokens in [1,"),
])
def test_bad_values_are_parse_errors_naming_the_series(metric: str, value: str, problem: str) -> None:
    with pytest.raises(SourceError) as err:
        sglang_facts(_set(NEW, metric, value), cfg())
    assert err.value.reason == "parse"
    assert str(err.value).startswith(f"{metric}{{") and problem in str(err.value)


def test_rank_labels_must_be_small_ranks() -> None:
    with pytest.raises(SourceError, match=r'label tp_rank=.* is not a number in 0\.\.1023'):
        sglang_facts(NEW.replace('tp_rank="0"', 'tp_rank="' + "9" * 5000 + '"', 1), cfg())


def test_missing_capacity_names_what_to_turn_on() -> None:
    text = "\n".join(line for line in NEW.splitlines() if "max_total_num_tokens" not in line) + "\n"
    with pytest.raises(SourceError) as err:
        sglang_facts(text, cfg())
    assert err.value.reason == "missing" and "--enable-metrics" in str(err.value)


def test_cache_hit_rate_is_ignored() -> None:
    a = sglang_facts(NEW, cfg())
    b = sglang_facts(_set(NEW, "sglang:cache_hit_rate", "0.99"), cfg())
    assert a == b
