"""TGI /metrics -> EngineFacts: goldens, the reservation as an exact per-request fact, the
physical state absent, the block_size option, errors.

Regenerate the goldens (read the diff): see tests/engine_golden.py.
"""

from __future__ import annotations

import pytest
from accounting_support import accounts_of
from engine_golden import FIXTURES, check_golden

from kvledger.collect.merge import configured_facts, merge
from kvledger.collect.sources.base import SourceError
from kvledger.collect.sources.tgi.metrics import tgi_facts
from kvledger.config.types import EngineConfig
from kvledger.domain.facts import Snapshot
from kvledger.domain.measure import Measure

DIR = FIXTURES / "tgi"
V3 = (DIR / "tgi-3-flashinfer-metrics.txt").read_text()
V2 = (DIR / "tgi-2-paged-metrics.txt").read_text()


def cfg(block_size: int | None = None, **kw) -> EngineConfig:  # type: ignore[no-untyped-def]
    options = (("block_size", str(block_size)),) if block_size is not None else ()
    base = dict(name="tgi", kind="tgi", url="http://127.0.0.1:3000/metrics", options=options, max_model_len=8192)
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


CASES = {"tgi-3-flashinfer-metrics": cfg(block_bytes=131072), "tgi-2-paged-metrics": cfg(16, block_bytes=2 << 20)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name: str) -> None:
    check_golden(tgi_facts((DIR / f"{name}.txt").read_text(), CASES[name]), DIR / "golden" / f"{name}.json")


def test_reservation_is_exact_and_nothing_physical_is_claimed() -> None:
    facts = tgi_facts(V3, cfg(block_bytes=131072))
    (pool,) = facts.pools
    # flashinfer: one token per block; 252608 tokens of capacity, 61877 reserved
    assert (pool.block_size, pool.num_blocks, pool.reserved_blocks, pool.running_requests) == (1, 252608, 61877, 9)
    assert pool.in_use is None and pool.engine_reported_used_blocks is None and pool.unreferenced_blocks is None
    assert facts.request_counts is not None and (facts.request_counts.running, facts.request_counts.waiting) == (9, 2)
    engine = merge(facts, configured_facts(cfg(block_bytes=131072)))
    assert (engine.admission, engine.overflow) == ("reserve-cap", "reject")
    (p,) = accounts_of(Snapshot(engines=[engine])).engines[0].pools
    assert p.reserved_blocks == Measure(exact=61877)
    assert p.bytes_of(p.reserved_blocks) == Measure(exact=61877 * 131072)
    assert p.quota_headroom_blocks == Measure(exact=252608 - 61877)
    assert p.physical.in_use is None and p.physical.allocated is None and p.physical.reclaimable is None
    assert p.physical_headroom_blocks is None
    (q,) = accounts_of(Snapshot(engines=[engine], sharing="reference-aware")).engines[0].pools
    assert q.reserved_blocks == Measure(upper=61877)


def test_paged_block_size_option() -> None:
    (pool,) = tgi_facts(V2, cfg(16)).pools
    assert (pool.block_size, pool.num_blocks, pool.reserved_blocks) == (16, 6144, 2560)


def test_wrong_block_size_is_a_config_error_saying_so() -> None:
    with pytest.raises(SourceError) as err:
        tgi_facts(V3, cfg(16))  # 252608 is a multiple of 16, 61877 is not
    assert err.value.reason == "config" and "tgi_batch_current_max_tokens" in str(err.value)
    assert "block_size" in str(err.value)


@pytest.mark.parametrize(("metric", "value", "problem"), [
    ("tgi_batch_current_max_tokens", "NaN", "is not finite"),
    ("tgi_batch_max_total_tokens", "-5", "is negative"),
    ("tgi_batch_current_size", "1.5", "is not a whole number of requests"),
    ("tgi_queue_size", "1e20", "exceeds"),
    ("tgi_queue_size", "2e9", "is not a number of requests in [0, 1073741824]"),
])
def test_bad_values_are_parse_errors_naming_the_series(metric: str, value: str, problem: str) -> None:
    lines = [f"{metric} {value}" if line.startswith(metric + " ") else line for line in V3.splitlines()]
    with pytest.raises(SourceError) as err:
        tgi_facts("\n".join(lines) + "\n", cfg())
    assert err.value.reason == "parse" and str(err.value).startswith(metric + "{}") and problem in str(err.value)


def test_before_warmup_capacity_is_missing() -> None:
    text = "\n".join(line for line in V3.splitlines() if "tgi_batch_max_total_tokens" not in line) + "\n"
    with pytest.raises(SourceError) as err:
        tgi_facts(text, cfg())
    assert err.value.reason == "missing" and "after warmup" in str(err.value)
