"""Fuzzing vLLM's /metrics mapping: mutations of the real captures in tests/fixtures/vllm/
(sample values replaced by nan/inf/-1/1e308/huge, label values mangled, lines dropped,
duplicated or truncated, cache_config_info labels broken).

Each case: ``vllm_facts_from_metrics`` raises SourceError (``parse``, ``missing``) or
returns facts within the protocol's ranges that account and render cleanly.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fuzz_support import FUZZ, assert_exports_cleanly, assert_facts_in_range, parse_exposition_samples
from hypothesis import event, given
from hypothesis import strategies as st

from kvledger.collect.sources.base import SourceError
from kvledger.collect.sources.vllm.metrics import USAGE_CHECK, vllm_facts_from_metrics
from kvledger.config.model import EngineConfig
from kvledger.model.facts import Snapshot
from kvledger.policy.engine_accounts import compute_accounts

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
        kind = draw(st.integers(0, 5))
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
    accounts = compute_accounts(Snapshot(engines=[facts]))
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
