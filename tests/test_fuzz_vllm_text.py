"""Fuzzing vLLM's /metrics mapping: mutations of the real captures in tests/fixtures/vllm/
(sample values replaced by nan/inf/-1/1e308/huge, label values mangled, timestamps of 312
digits appended, lines dropped, duplicated or truncated, cache_config_info labels broken),
and expositions of many data-parallel ranks and API servers whose values are each in range
but whose sums are not.

Each case: ``vllm_facts_from_metrics`` raises SourceError (``parse``, ``missing``) or
returns facts within the protocol's ranges that account and render cleanly, every
exported number within 2**53 - 1 unless the exposition check refuses the engine.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from accounting_support import accounts_of
from fuzz_exposition import TIMESTAMPS
from fuzz_support import FUZZ, assert_exports_cleanly, assert_facts_in_range, exported_alone, parse_exposition_samples
from hypothesis import event, given
from hypothesis import strategies as st

from kvledger.collect.sources.base import SourceError
from kvledger.collect.sources.vllm.metrics import USAGE_CHECK, WHOLE_BLOCKS_CHECK, vllm_facts_from_metrics
from kvledger.config.types import EngineConfig
from kvledger.domain.facts import Snapshot
from kvledger.domain.limits import MAX_SAFE_INT

FIXTURES = Path(__file__).parent / "fixtures" / "vllm"
CAPTURES = {p.name: p.read_text() for p in sorted(FIXTURES.glob("*.txt"))}
CFG = EngineConfig(name="fuzz", kind="vllm", url="http://127.0.0.1:8000/metrics", block_bytes=2 << 20,
                   max_model_len=8192, max_num_seqs=256, max_num_batched_tokens=8192, gpus=(0,))

VALUES = ("nan", "NaN", "+Inf", "-Inf", "-1", "-0.5", "0", "1", "1.5", "2.5", "1e308", "-1e308", "9007199254740993",
          "1e20", "9" * 400, "0x10", "", "abc")
LABEL_VALUES = ("nan", "inf", "-inf", "-5", "0", "1", "1.5", "1e308", "None", "True", "", "0x10", "9" * 5000, "2.0",
                "4294967297", "9007199254740993", "\\\"", "1_000", " 12 ", "é")
CONFIG_LABELS = ("block_size", "num_gpu_blocks", "kv_cache_memory_bytes", "sliding_window")
_SAMPLE = re.compile(r"^(?P<series>[a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) (?P<value>\S+)(?P<rest>.*)$")
_LABEL = re.compile(r'(?P<name>[a-zA-Z_][a-zA-Z0-9_]*)="(?P<value>[^"]*)"')


@st.composite
def mutated_captures(draw: st.DrawFn) -> str:
    lines = CAPTURES[draw(st.sampled_from(sorted(CAPTURES)))].split("\n")
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.integers(0, 6))
        samples = [i for i, line in enumerate(lines) if _SAMPLE.match(line) and not line.startswith("#")]
        if kind <= 1 and samples:  # a sample value replaced; vllm: series twice as likely
            vllm = [i for i in samples if lines[i].startswith("vllm:")] or samples
            i = draw(st.sampled_from(vllm))
            m = _SAMPLE.match(lines[i])
            assert m is not None
            lines[i] = f"{m['series']} {draw(st.sampled_from(VALUES))}{m['rest']}"
        elif kind == 2:  # a cache_config_info label or any label value mangled
            infos = [i for i, line in enumerate(lines) if line.startswith("vllm:cache_config_info{")]
            prefer_info: bool = draw(st.booleans())
            targets = infos if infos and prefer_info else [i for i in samples if "{" in lines[i]]
            if targets:
                i = draw(st.sampled_from(targets))
                labels = list(_LABEL.finditer(lines[i]))
                wanted = [m for m in labels if m["name"] in (*CONFIG_LABELS, "engine", "pid")] or labels
                if wanted:
                    m = draw(st.sampled_from(wanted))
                    lines[i] = lines[i][: m.start("value")] + draw(st.sampled_from(LABEL_VALUES)) + lines[i][m.end("value") :]
        elif kind == 3 and lines:  # a line dropped
            del lines[draw(st.integers(0, len(lines) - 1))]
        elif kind == 4 and lines:  # a line duplicated
            i = draw(st.integers(0, len(lines) - 1))
            lines.insert(draw(st.integers(0, len(lines))), lines[i])
        elif kind == 5 and samples:  # a timestamp appended (312 digits overflow the parser's int / 1000)
            i = draw(st.sampled_from(samples))
            m = _SAMPLE.match(lines[i])
            assert m is not None
            lines[i] = f"{m['series']} {m['value']} {draw(st.sampled_from(TIMESTAMPS))}"
        else:  # truncated
            text = "\n".join(lines)
            lines = text[: draw(st.integers(0, len(text)))].split("\n")
    return "\n".join(lines)


@FUZZ
@given(mutated_captures())
def test_fuzz_vllm_metrics(text: str) -> None:
    try:
        facts = vllm_facts_from_metrics(text, CFG)
    except SourceError as exc:
        assert exc.reason in ("parse", "missing"), exc
        event(f"rejected: {exc.reason}")
        return
    event("accepted" if not any(p.source_violations for p in facts.pools) else "accepted with a violation")
    assert_facts_in_range(facts)
    accounts = assert_exports_cleanly(facts)
    for pool in accounts.engines[0].pools:
        # never 190 of 127: what is exported lies within capacity
        used = pool.engine_reported_used_blocks
        assert used is None or 0 <= used <= pool.capacity_blocks
        in_use = pool.physical.in_use
        assert in_use is None or in_use.exact is None or 0 <= in_use.exact <= pool.capacity_blocks


# ---------------------------------------------------------------- the probe's findings, pinned

BASE = CAPTURES["vllm-0.32-like.txt"]


def _with_value(metric: str, value: str) -> str:
    return re.sub(rf"^({re.escape(metric)}\{{[^}}]*\}}) \S+", rf"\1 {value}", BASE, flags=re.MULTILINE)


def _with_label(label: str, value: str) -> str:
    return re.sub(rf'({label}=")[^"]*(")', rf"\g<1>{value}\g<2>", BASE)


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "1e308", "1.5", "9" * 5000])
def test_cache_config_labels_are_parse_errors_naming_the_label(value: str) -> None:
    with pytest.raises(SourceError) as err:
        vllm_facts_from_metrics(_with_label("num_gpu_blocks", value), CFG)
    assert err.value.reason == "parse"
    assert "vllm:cache_config_info label 'num_gpu_blocks'" in str(err.value)


@pytest.mark.parametrize(
    ("metric", "value", "problem"),
    [
        ("vllm:num_preemptions_total", "NaN", "is not finite"),
        ("vllm:num_preemptions_total", "-1", "is negative"),
        ("vllm:num_preemptions_total", "+Inf", "is not finite"),
        ("vllm:num_requests_running", "2.5", "is not a whole number of requests"),
        ("vllm:num_requests_waiting", "-3", "is negative"),
        ("vllm:kv_cache_usage_perc", "NaN", "is not finite"),
    ],
)
def test_non_finite_and_negative_values_are_parse_errors(metric: str, value: str, problem: str) -> None:
    with pytest.raises(SourceError) as err:
        vllm_facts_from_metrics(_with_value(metric, value), CFG)
    assert err.value.reason == "parse"
    assert str(err.value).startswith(f'{metric}{{engine="0",model_name="tiny"}}: value ') and problem in str(err.value)


@pytest.mark.parametrize("usage", ["1.5", "-0.25"])
def test_usage_outside_unit_interval_is_unknown_and_counted(usage: str) -> None:
    facts = vllm_facts_from_metrics(_with_value("vllm:kv_cache_usage_perc", usage), CFG)
    pool = facts.pools[0]
    assert pool.in_use is None and pool.engine_reported_used_blocks is None
    assert pool.source_violations == (USAGE_CHECK,)
    accounts = accounts_of(Snapshot(engines=[facts]))
    assert USAGE_CHECK in accounts.engines[0].invariant_violations
    accounts = assert_exports_cleanly(facts)
    from kvledger.output.prometheus import render_text

    names = {name for name, labels, _ in parse_exposition_samples(render_text(accounts)) if labels.get("engine") == "fuzz"}
    assert "kvledger_engine_reported_kv_used_blocks" not in names
    assert "kvledger_kv_blocks" not in names or all(
        labels.get("state") != "in_use"
        for name, labels, _ in parse_exposition_samples(render_text(accounts))
        if name == "kvledger_kv_blocks" and labels.get("engine") == "fuzz"
    )


@pytest.mark.parametrize("rank", ["9" * 5000, "\u00b2", "01", "1024", "-1", "x"])
def test_rank_label_must_be_a_small_rank(rank: str) -> None:
    # int() of 5,000 digits raised ValueError (reason "internal"); '\u00b2'.isdigit() is True but int() fails
    with pytest.raises(SourceError) as err:
        vllm_facts_from_metrics(BASE.replace('engine="0"', f'engine="{rank}"'), CFG)
    assert err.value.reason == "parse" and "is not a data-parallel rank (0..1023)" in str(err.value)


def test_usage_within_range_is_exported() -> None:
    facts = vllm_facts_from_metrics(_with_value("vllm:kv_cache_usage_perc", "1.0"), CFG)
    assert facts.pools[0].in_use == facts.pools[0].num_blocks and facts.pools[0].source_violations == ()


def test_capacity_beyond_float_exactness_is_a_parse_error() -> None:
    with pytest.raises(SourceError, match=r"kv_cache_memory_bytes|bytes per block"):
        vllm_facts_from_metrics(_with_label("kv_cache_memory_bytes", str(2**62)), CFG)


# ---------------------------------------------------------------- hardening round two (issue 25), pinned


@pytest.mark.parametrize("stamp", ["9" * 312, "-" + "9" * 312, "9" * 400, "9" * 5000, "1e400", "1.5", "9223372036854775808"])
def test_a_timestamp_no_int64_holds_is_a_parse_error(stamp: str) -> None:
    # "a 1 999...9" (312 digits) raised OverflowError out of prometheus_client's parser: the
    # engine went down as "internal" with a traceback logged at every poll; 5,000 digits and
    # 1e400 it read as float("inf") and ignored. A timestamp is an int64 of milliseconds (as
    # Prometheus reads it): anything else is a parse error, whatever its length
    text = BASE + f"vllm:num_requests_running{{engine=\"0\",model_name=\"tiny\"}} 3.0 {stamp}\n"
    with pytest.raises(SourceError) as err:
        vllm_facts_from_metrics(text, CFG)
    assert err.value.reason == "parse" and "invalid exposition line" in str(err.value)
    assert "is not a count of milliseconds (an int64)" in str(err.value)


@pytest.mark.parametrize("stamp", ["1700000000000", "-1", "9223372036854775807"])
def test_a_timestamp_is_ignored(stamp: str) -> None:
    text = BASE + f"vllm:num_requests_waiting_by_reason{{engine=\"0\",model_name=\"tiny\",reason=\"x\"}} 1.0 {stamp}\n"
    assert vllm_facts_from_metrics(text, CFG) == vllm_facts_from_metrics(BASE, CFG)


def _ranks(n: int, running: str, prefix_hits: str = "0") -> str:
    """vLLM's /metrics of ``n`` data-parallel ranks, each with ``running`` requests."""
    lines = []
    for r in range(n):
        labels = f'engine="{r}",model_name="m"'
        lines += [f"vllm:num_requests_running{{{labels}}} {running}", f"vllm:num_requests_waiting{{{labels}}} 0.0",
                  f"vllm:kv_cache_usage_perc{{{labels}}} 0.0", f"vllm:prefix_cache_hits_total{{{labels}}} {prefix_hits}",
                  f"vllm:prefix_cache_queries_total{{{labels}}} {prefix_hits}",
                  f'vllm:cache_config_info{{block_size="16",{labels},num_gpu_blocks="{n * 1025}"}} 1.0']
    return "\n".join(lines) + "\n"


def test_running_requests_summed_over_ranks_beyond_2_53_are_not_exported() -> None:
    # each rank's count is in range; the sum over 2 ranks is 9,007,199,254,740,995 (the probe's)
    text = _ranks(2, str(2**52 + 2) + ".0")
    facts = vllm_facts_from_metrics(text, CFG)
    assert facts.request_counts is not None and facts.request_counts.running == 9_007_199_254_740_996
    accounts = assert_exports_cleanly(facts)
    assert not exported_alone(accounts.engines[0], Snapshot(engines=[facts]))


def test_prefix_cache_tokens_summed_over_ranks_beyond_2_53_are_not_exported() -> None:
    facts = vllm_facts_from_metrics(_ranks(3, "1.0", "3.7e15"), CFG)  # about 1.1e16 in all
    assert facts.counters["prefix_cache_hit_tokens"] > MAX_SAFE_INT
    accounts = assert_exports_cleanly(facts)
    assert not exported_alone(accounts.engines[0], Snapshot(engines=[facts]))


@st.composite
def summed_ranks(draw: st.DrawFn) -> str:
    """Many ranks (and, at times, two API-server pids per rank) whose values are each within
    2**53 - 1 but whose sums may not be."""
    big = st.sampled_from(["0.0", "1.0", str(2**52) + ".0", str(2**53 - 1) + ".0", "4.5e15", "3.7e15", "9.0e15"])
    n = draw(st.integers(1, 6))
    pids = draw(st.sampled_from([(None,), ("4701", "4702")]))
    lines = []
    for r in range(n):
        for pid in pids:
            labels = f'engine="{r}",model_name="m"' + (f',pid="{pid}"' if pid else "")
            lines += [f"vllm:num_requests_running{{{labels}}} {draw(big)}",
                      f"vllm:num_requests_waiting{{{labels}}} {draw(big)}",
                      f"vllm:kv_cache_usage_perc{{{labels}}} {draw(st.sampled_from(['0.0', '0.5', '1.0']))}",
                      f"vllm:num_preemptions_total{{{labels}}} {draw(big)}",
                      f"vllm:prefix_cache_hits_total{{{labels}}} {draw(big)}",
                      f"vllm:prefix_cache_queries_total{{{labels}}} {draw(big)}",
                      f'vllm:cache_config_info{{block_size="16",{labels},num_gpu_blocks="{n * 1025}"}} 1.0']
    return "\n".join(lines) + "\n"


@FUZZ
@given(summed_ranks())
def test_fuzz_sums_over_ranks_and_api_servers(text: str) -> None:
    try:
        facts = vllm_facts_from_metrics(text, CFG)
    except SourceError as exc:
        assert exc.reason in ("parse", "missing"), exc
        return
    accounts = assert_exports_cleanly(facts)  # every exported number within 2**53 - 1, or the engine invalid
    event("invalid (a sum beyond 2**53 - 1)" if not exported_alone(accounts.engines[0], Snapshot(engines=[facts]))
          else "exported")


@pytest.mark.parametrize(("usage", "usable"), [(0.5, 2047), (0.1, 127), (0.4231, 27647)])
def test_a_usage_that_is_no_whole_number_of_blocks_is_not_exact(usage: float, usable: int) -> None:
    # 0.5 of 2,047 usable blocks is 1,023.5: it was exported as in_use 1024, basis "exact"
    text = _ranks(1, "1.0").replace("kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.0",
                                    f"kv_cache_usage_perc{{engine=\"0\",model_name=\"m\"}} {usage!r}")
    text = text.replace('num_gpu_blocks="1025"', f'num_gpu_blocks="{usable + 1}"')
    facts = vllm_facts_from_metrics(text, CFG)
    (pool,) = facts.pools
    assert pool.num_blocks == usable and pool.in_use is None and pool.engine_reported_used_blocks is None
    assert pool.source_violations == (WHOLE_BLOCKS_CHECK,)
    accounts = accounts_of(Snapshot(engines=[facts]))
    assert WHOLE_BLOCKS_CHECK in accounts.engines[0].invariant_violations
    # never exact: the bound pair of the reading's floor and ceiling (1,023 and 1,024 for 1,023.5)
    in_use = accounts.engines[0].pools[0].physical.in_use
    assert in_use is not None and in_use.exact is None
    assert (in_use.lower, in_use.upper) == (math.floor(usage * usable), math.ceil(usage * usable))


@pytest.mark.parametrize("used", [0, 1, 255, 1023, 1024, 2046, 2047])
def test_a_usage_as_vllm_computes_it_is_exact(used: int) -> None:
    usage = 1.0 - (2047 - used) / 2047  # vllm.v1.core.block_pool.BlockPool.get_usage
    text = _ranks(1, "1.0").replace("kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.0",
                                    f"kv_cache_usage_perc{{engine=\"0\",model_name=\"m\"}} {usage!r}")
    facts = vllm_facts_from_metrics(text.replace('num_gpu_blocks="1025"', 'num_gpu_blocks="2048"'), CFG)
    assert facts.pools[0].in_use == used and facts.pools[0].source_violations == ()


@FUZZ
@given(st.integers(1, 2**32 - 1), st.data())
def test_fuzz_usage_of_whole_blocks_is_exact_at_every_size(usable: int, data: st.DataObject) -> None:
    used = data.draw(st.integers(0, usable))
    usage = 1.0 - (usable - used) / usable
    text = _ranks(1, "1.0").replace("kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.0",
                                    f"kv_cache_usage_perc{{engine=\"0\",model_name=\"m\"}} {usage!r}")
    facts = vllm_facts_from_metrics(text.replace('num_gpu_blocks="1025"', f'num_gpu_blocks="{usable + 1}"'), CFG)
    assert facts.pools[0].in_use == used
