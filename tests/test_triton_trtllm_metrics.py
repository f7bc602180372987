"""Triton + TensorRT-LLM backend /metrics -> EngineFacts: goldens for both spellings of the
backend's families, hand-computed facts, errors and violations.

Regenerate the goldens (read the diff): see tests/engine_golden.py.
"""

from __future__ import annotations

import pytest
from accounting_support import accounts_of
from engine_golden import FIXTURES, check_golden

from kvledger.collect.sources.base import SourceError
from kvledger.collect.sources.triton_trtllm.metrics import PAUSED_CHECK, USED_CHECK, triton_trtllm_facts
from kvledger.config.types import EngineConfig
from kvledger.domain.facts import Snapshot
from kvledger.domain.measure import Measure

DIR = FIXTURES / "triton-trtllm"
NEW = (DIR / "triton-trtllm-metrics-names-metrics.txt").read_text()
OLD = (DIR / "triton-trtllm-statistics-names-metrics.txt").read_text()
CFG = EngineConfig(name="triton", kind="triton-trtllm", url="http://127.0.0.1:8002/metrics", block_bytes=1 << 20)


@pytest.mark.parametrize("name", ["triton-trtllm-metrics-names-metrics", "triton-trtllm-statistics-names-metrics"])
def test_golden(name: str) -> None:
    check_golden(triton_trtllm_facts((DIR / f"{name}.txt").read_text(), CFG), DIR / "golden" / f"{name}.json")


def test_metrics_names_with_paused_requests() -> None:
    facts = triton_trtllm_facts(NEW, CFG)
    (pool,) = facts.pools
    assert (pool.id, pool.block_size, pool.num_blocks, pool.in_use, pool.unreferenced_blocks) == ("tensorrt_llm", 64, 4096, 1536, 2560)
    assert pool.running_requests == 9 and pool.engine_reported_used_blocks == 1536.0
    assert facts.request_counts is not None
    assert (facts.request_counts.running, facts.request_counts.waiting, facts.request_counts.preempted) == (8, None, 1)
    assert facts.budgets.max_num_seqs == 32
    assert facts.reported_memory == {"gpu": 71940702208, "cpu": 2147483648, "pinned": 1073741824}
    (p,) = accounts_of(Snapshot(engines=[facts])).engines[0].pools
    assert p.physical.reclaimable == Measure(upper=2560) and p.physical_headroom_blocks == Measure(exact=2560)
    assert p.bytes_of(p.physical.in_use) == Measure(exact=1536 << 20)


def test_first_statistics_spelling_is_read_alike() -> None:
    facts = triton_trtllm_facts(OLD, CFG)
    (pool,) = facts.pools
    assert (pool.num_blocks, pool.in_use, pool.unreferenced_blocks, pool.running_requests) == (4096, 1024, 3072, 7)
    assert facts.request_counts is not None and facts.request_counts.preempted is None  # no paused_requests then


def test_later_request_type_waiting_is_read() -> None:
    text = NEW.replace('request_type="context"} 2', 'request_type="context"} 2\n'
                       'nv_trt_llm_request_metrics{model="tensorrt_llm",version="1",request_type="waiting"} 5')
    text = text.replace('kv_cache_block_type="reused"} 40110', 'kv_cache_block_type="reused"} 40110\n'
                        'nv_trt_llm_kv_cache_block_metrics{model="tensorrt_llm",version="1",kv_cache_block_type="fraction"} 0')
    facts = triton_trtllm_facts(text, CFG)
    assert facts.request_counts is not None and facts.request_counts.waiting == 5


def test_two_versions_of_a_model_are_two_pools() -> None:
    extra = "\n".join(line.replace('version="1"', 'version="2"') for line in NEW.splitlines()
                      if line.startswith("nv_trt_llm_kv_cache_block_metrics{"))
    facts = triton_trtllm_facts(NEW + extra + "\n", CFG)
    assert [p.id for p in facts.pools] == ["tensorrt_llm/1", "tensorrt_llm/2"]


def test_violations() -> None:
    text = NEW.replace('kv_cache_block_type="used"} 1536', 'kv_cache_block_type="used"} 5000')
    text = text.replace('inflight_batcher_specific_metric="paused_requests"} 1', 'inflight_batcher_specific_metric="paused_requests"} 10')
    (pool,) = triton_trtllm_facts(text, CFG).pools
    assert pool.source_violations == (USED_CHECK, PAUSED_CHECK) and pool.in_use is None


@pytest.mark.parametrize(("old", "new", "problem"), [
    ('kv_cache_block_type="max"} 4096', 'kv_cache_block_type="max"} 0', "is not a number of blocks in [1,"),
    ('kv_cache_block_type="free"} 2560', 'kv_cache_block_type="free"} NaN', "is not finite"),
    ('request_type="active"} 9', 'request_type="active"} 2.5', "is not a whole number of requests"),
    ('memory_type="gpu"} 71940702208', 'memory_type="gpu"} -1', "is negative"),
])
def test_bad_values_are_parse_errors_naming_the_series(old: str, new: str, problem: str) -> None:
    with pytest.raises(SourceError) as err:
        triton_trtllm_facts(NEW.replace(old, new), CFG)
    assert err.value.reason == "parse" and str(err.value).startswith("nv_trt_llm_") and problem in str(err.value)


def test_no_tensorrt_llm_model_is_missing() -> None:
    text = "\n".join(line for line in NEW.splitlines() if "kv_cache_block" not in line) + "\n"
    with pytest.raises(SourceError) as err:
        triton_trtllm_facts(text, CFG)
    assert err.value.reason == "missing" and "8002" in str(err.value)
