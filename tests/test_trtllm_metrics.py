"""trtllm-serve's /prometheus/metrics -> EngineFacts: goldens, hand-computed facts and bases,
errors for bad values, and the refusal of the destructive JSON /metrics.

Regenerate the goldens (read the diff): see tests/engine_golden.py.
"""

from __future__ import annotations

import re

import pytest
from accounting_support import accounts_of
from engine_golden import FIXTURES, check_golden

from kvledger.collect.merge import configured_facts, merge
from kvledger.collect.sources.base import SourceError
from kvledger.collect.sources.registry import engine_sources
from kvledger.collect.sources.trtllm.metrics import PAUSED_CHECK, USED_CHECK, trtllm_facts
from kvledger.config.types import ConfigError, EngineConfig
from kvledger.domain.facts import Snapshot
from kvledger.domain.measure import Measure

DIR = FIXTURES / "trtllm"
FULL = (DIR / "trtllm-serve-block-gauges-metrics.txt").read_text()
OLD = (DIR / "trtllm-serve-utilization-only-metrics.txt").read_text()


def cfg(**kw) -> EngineConfig:  # type: ignore[no-untyped-def]
    base = dict(name="trt", kind="trtllm", url="http://127.0.0.1:8000/prometheus/metrics", max_model_len=4096)
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


def test_golden() -> None:
    name = "trtllm-serve-block-gauges-metrics"
    check_golden(trtllm_facts((DIR / f"{name}.txt").read_text(), cfg(block_bytes=4 << 20)), DIR / "golden" / f"{name}.json")


def _set(text: str, metric: str, value: str) -> str:
    out, n = re.subn(rf"^({re.escape(metric)}\{{[^}}]*\}}) \S+$", rf"\g<1> {value}", text, flags=re.MULTILINE)
    assert n, metric
    return out


def test_blocks_used_exact_and_free_includes_reusable_cached_blocks() -> None:
    facts = trtllm_facts(FULL, cfg(block_bytes=4 << 20))
    (pool,) = facts.pools
    assert (pool.id, pool.block_size, pool.num_blocks, pool.in_use, pool.unreferenced_blocks) == ("0", 32, 8192, 2048, 6144)
    assert pool.free is None and pool.reclaimable is None  # TensorRT-LLM's free holds reusable blocks
    assert pool.engine_reported_used_blocks == 2048.0 and pool.running_requests == 14
    assert facts.request_counts is not None
    # 14 active of which 2 paused: 12 running, 2 preempted
    assert (facts.request_counts.running, facts.request_counts.waiting, facts.request_counts.preempted) == (12, 3, 2)
    assert (facts.budgets.max_num_seqs, facts.budgets.max_num_batched_tokens) == (64, 8192)
    assert facts.reported_memory == {"gpu": 71940702208, "cpu": 2147483648, "pinned": 1073741824}
    engine = merge(facts, configured_facts(cfg(block_bytes=4 << 20)))
    assert (engine.admission, engine.overflow) == ("reserve-cap", "preempt-recompute")  # GUARANTEED_NO_EVICT default
    (p,) = accounts_of(Snapshot(engines=[engine])).engines[0].pools
    assert p.physical.in_use == Measure(exact=2048)
    assert p.physical.reclaimable == Measure(upper=6144) and p.physical.free == Measure(upper=6144)
    assert p.physical_headroom_blocks == Measure(exact=6144)
    # reservations: 14 admitted x ceil(4096 / 32) = 1792 blocks at most, never below in-use
    assert p.reserved_blocks == Measure(upper=2048)


def test_max_utilization_is_configured_as_dynamic() -> None:
    engine = merge(trtllm_facts(FULL, cfg()), configured_facts(cfg(admission="dynamic")))
    assert engine.admission == "dynamic"


def test_only_utilization_is_a_clear_missing_error() -> None:
    with pytest.raises(SourceError) as err:
        trtllm_facts(OLD, cfg())
    assert err.value.reason == "missing"
    assert "exports only trtllm_kv_cache_utilization" in str(err.value) and "enable_iter_perf_stats" in str(err.value)


def test_used_above_capacity_and_paused_above_active_are_violations() -> None:
    (pool,) = trtllm_facts(_set(_set(FULL, "trtllm_kv_cache_used_blocks", "9000.0"), "trtllm_num_paused_requests", "20.0"),
                           cfg()).pools
    assert pool.source_violations == (USED_CHECK, PAUSED_CHECK)
    assert pool.in_use is None and pool.unreferenced_blocks is None and pool.engine_reported_used_blocks is None


def test_used_plus_free_not_capacity_is_counted_by_the_policy() -> None:
    facts = trtllm_facts(_set(FULL, "trtllm_kv_cache_free_blocks", "7000.0"), cfg())
    e = accounts_of(Snapshot(engines=[facts])).engines[0]
    assert "unreferenced_partition" in e.invariant_violations
    assert e.pools[0].physical.in_use is None


@pytest.mark.parametrize(("metric", "value", "problem"), [
    ("trtllm_kv_cache_max_blocks", "0.0", "is not a number of blocks in [1,"),
    ("trtllm_kv_cache_used_blocks", "NaN", "is not finite"),
    ("trtllm_kv_cache_free_blocks", "-1.0", "is negative"),
    ("trtllm_kv_cache_tokens_per_block", "1.5", "is not a whole number of tokens"),
    ("trtllm_num_requests_running", "+Inf", "is not finite"),
    ("trtllm_gpu_memory_usage_bytes", "1e300", "exceeds"),
])
def test_bad_values_are_parse_errors_naming_the_series(metric: str, value: str, problem: str) -> None:
    with pytest.raises(SourceError) as err:
        trtllm_facts(_set(FULL, metric, value), cfg())
    assert err.value.reason == "parse" and str(err.value).startswith(f"{metric}{{") and problem in str(err.value)


def test_two_engine_types_are_two_pools() -> None:
    extra = "\n".join(line.replace('engine_type="trtllm"', 'engine_type="pytorch"') for line in FULL.splitlines()
                      if line.startswith("trtllm_kv_cache_") or line.startswith("trtllm_num_requests_running"))
    facts = trtllm_facts(FULL + extra + "\n", cfg())
    assert [p.id for p in facts.pools] == ["pytorch", "trtllm"]


def test_the_destructive_json_metrics_url_is_refused_at_configuration() -> None:
    with pytest.raises(ConfigError, match=r"JSON /metrics, which removes what it returns; use GET /prometheus/metrics"):
        engine_sources(cfg(url="http://127.0.0.1:8000/metrics"))
    (source,) = engine_sources(cfg())
    source.close()
