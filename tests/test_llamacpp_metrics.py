"""llama.cpp's /slots, /props and /metrics -> EngineFacts: golden files per version (a real
b11434 server, split and unified KV; the builds before the KV gauges were removed), the
hand-computed figures and bases, and the errors for bad values.

Regenerate the golden JSON files (after checking the differences):
    KVLEDGER_REGEN=1 PYTHONPATH=exporter python -m pytest tests/test_llamacpp_metrics.py -q
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
from accounting_support import accounts_of

from kvledger.collect.merge import configured_facts, merge
from kvledger.collect.sources.base import SourceError
from kvledger.collect.sources.llamacpp.documents import parse_props, parse_slots
from kvledger.collect.sources.llamacpp.mapping import TOKENS_CHECK, USAGE_CHECK, llamacpp_facts
from kvledger.collect.sources.llamacpp.metrics import parse_metrics
from kvledger.config.types import EngineConfig
from kvledger.domain.accounts import EngineAccount
from kvledger.domain.facts import EngineFacts, Snapshot
from kvledger.policy.invariants import ENGINE_RESERVED_CHECK

FIXTURES = Path(__file__).parent / "fixtures" / "llamacpp"
GOLDEN = FIXTURES / "golden"
REGEN = os.environ.get("KVLEDGER_REGEN") == "1"
KIB = 1024


def _cfg(**kw: Any) -> EngineConfig:
    options: list[tuple[str, str]] = []
    if (unified := kw.pop("kv_unified", None)) is not None:
        options.append(("kv_unified", "true" if unified else "false"))
    if (size := kw.pop("kv_size", None)) is not None:
        options.append(("kv_size", str(size)))
    base: dict[str, Any] = dict(name="llama", kind="llamacpp", url="http://127.0.0.1:8080/metrics", options=tuple(options))
    base.update(kw)
    return EngineConfig(**base)


#: the tiny model of tests/llamacpp_real: 2 layers x 2 KV heads x 16 dims x (K, V) x f16
TINY_BYTES_PER_TOKEN = 2 * 2 * 16 * 2 * 2
CASES = {
    "llamacpp-pre13660": _cfg(block_bytes=32 * KIB),
    "llamacpp-b11434-split-idle": _cfg(block_bytes=TINY_BYTES_PER_TOKEN),
    "llamacpp-b11434-split-busy": _cfg(block_bytes=TINY_BYTES_PER_TOKEN),
    # -c 8192 --kv-unified: the slots show 4096 (the model's training context), not the buffer
    "llamacpp-b11434-unified-busy": _cfg(block_bytes=TINY_BYTES_PER_TOKEN, kv_unified=True, kv_size=8192),
}


def read_case(name: str) -> tuple[bytes, bytes, str | None]:
    metrics = FIXTURES / f"{name}-metrics.txt"
    return ((FIXTURES / f"{name}-slots.json").read_bytes(), (FIXTURES / f"{name}-props.json").read_bytes(),
            metrics.read_text() if metrics.exists() else None)


def facts_of(name: str, cfg: EngineConfig | None = None) -> EngineFacts:
    slots, props, metrics = read_case(name)
    return llamacpp_facts(parse_slots(slots), parse_props(props), None if metrics is None else parse_metrics(metrics),
                          cfg or CASES[name])


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name: str) -> None:
    facts = facts_of(name)
    got = json.loads(json.dumps(dataclasses.asdict(facts), sort_keys=True))
    path = GOLDEN / f"{name}.json"
    if REGEN:
        path.write_text(json.dumps(got, indent=2, sort_keys=True) + "\n")
    assert got == json.loads(path.read_text())


def _accounts(facts: EngineFacts, cfg: EngineConfig) -> EngineAccount:
    return accounts_of(Snapshot(engines=[merge(facts, configured_facts(cfg))])).engines[0]


# ---------------------------------------------------------------- the real b11434 captures


def _slots(name: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = json.loads((FIXTURES / f"{name}-slots.json").read_text())
    return out


def test_b11434_split_busy_by_hand() -> None:
    """Summed here from the capture: busy slots' n_prompt_tokens in use, idle ones reclaimable."""
    name = "llamacpp-b11434-split-busy"
    slots = _slots(name)
    busy = [s for s in slots if s["is_processing"]]
    facts = facts_of(name)
    (pool,) = facts.pools
    assert (pool.block_size, pool.num_blocks, pool.block_bytes) == (1, 4 * 2048, TINY_BYTES_PER_TOKEN)
    assert pool.in_use == sum(s["n_prompt_tokens"] for s in busy) and pool.in_use > 0
    assert pool.reclaimable == sum(s.get("n_prompt_tokens", 0) for s in slots if not s["is_processing"])
    assert pool.reserved_blocks == 2048 * len(busy) and pool.running_requests == len(busy)
    assert pool.engine_reported_used_blocks is None  # no KV gauge in b11434
    metrics = (FIXTURES / f"{name}-metrics.txt").read_text()
    assert f"llamacpp:requests_processing {len(busy)}\n" in metrics  # the engine's own count, same moment
    values = dict(line.split(" ", 1) for line in metrics.splitlines() if line.startswith("llamacpp:"))
    hits, evaluated = float(values["llamacpp:prompt_tokens_cached_total"]), float(values["llamacpp:prompt_tokens_total"])
    assert facts.counters == {"prefix_cache_hit_tokens": hits, "prefix_cache_queried_tokens": hits + evaluated}
    assert facts.version == "b11434-b11434"
    acc = _accounts(facts, CASES[name])
    (p,) = acc.pools
    assert p.physical.free is not None and p.physical.free.exact == 8192 - pool.in_use - pool.reclaimable
    assert p.admission_headroom_requests is not None and p.admission_headroom_requests.exact == 4 - len(busy)
    assert acc.invariant_violations == []


def test_b11434_split_idle_by_hand() -> None:
    name = "llamacpp-b11434-split-idle"
    slots = _slots(name)
    (pool,) = facts_of(name).pools
    assert not any(s["is_processing"] for s in slots)
    assert (pool.in_use, pool.reserved_blocks, pool.running_requests) == (0, 0, 0)
    # idle slots keep prompt + generated tokens for reuse: all reclaimable
    assert pool.reclaimable == sum(s.get("n_prompt_tokens", 0) for s in slots) > 0


def test_b11434_unified_busy_by_hand() -> None:
    name = "llamacpp-b11434-unified-busy"
    slots = _slots(name)
    facts = facts_of(name)
    (pool,) = facts.pools
    assert {s["n_ctx"] for s in slots} == {4096} and pool.num_blocks == 8192  # kv_size, not the slots
    assert pool.in_use == sum(s.get("n_prompt_tokens", 0) for s in slots if s["is_processing"]) > 0
    assert pool.reserved_blocks is None and facts.admission == "dynamic"
    acc = _accounts(facts, CASES[name])
    reserved = acc.pools[0].reserved_blocks
    assert reserved is not None and reserved.exact is None
    assert reserved.upper == max(4096 * sum(s["is_processing"] for s in slots), pool.in_use)
    # without kv_size the capacity would be a slot's 4096
    assert facts_of(name, _cfg(block_bytes=TINY_BYTES_PER_TOKEN, kv_unified=True)).pools[0].num_blocks == 4096


# ---------------------------------------------------------------- the builds with the KV gauges


def test_pre13660_gauges_are_the_engines_claim_and_slots_give_the_reservation() -> None:
    """Written from source (examples/server/server.cpp at 61e588ab): four slots of 2048
    tokens, two busy; kv_cache_usage_ratio 0.389038 of an 8192-token context."""
    facts = facts_of("llamacpp-pre13660")
    (pool,) = facts.pools
    assert (pool.block_size, pool.num_blocks, pool.block_bytes) == (1, 4 * 2048, 32 * KIB)
    # the used cells over the context: busy and idle slots alike; the engine's claim only
    assert pool.engine_reported_used_blocks == pytest.approx(0.389038 * 8192)
    # these builds report no token count per slot: the physical split is unknown
    assert (pool.in_use, pool.reclaimable, pool.free) == (None, None, None)
    assert pool.running_requests == 2 and pool.reserved_blocks == 2 * 2048
    assert (facts.budgets.max_model_len, facts.budgets.max_num_seqs) == (2048, 4)
    assert facts.request_counts is not None and (facts.request_counts.running, facts.request_counts.waiting) == (2, 1)
    assert facts.counters == {}  # no cached-prompt counter yet: the prefix-cache counters are unknown
    assert facts.version == "b0-unknown"
    acc = _accounts(facts, CASES["llamacpp-pre13660"])
    assert acc.facts.admission == "reserve-cap" and acc.facts.overflow == "reject"
    (p,) = acc.pools
    assert p.reserved_blocks is not None and p.reserved_blocks.exact == 4096
    assert p.quota_headroom_blocks is not None and p.quota_headroom_blocks.exact == 8192 - 4096
    assert p.admission_headroom_requests is not None and p.admission_headroom_requests.exact == 2  # two idle slots
    assert p.physical.in_use is None and p.physical.free is None
    assert acc.invariant_violations == []


@pytest.mark.parametrize("ratio", ["1.5", "-0.25"])
def test_usage_ratio_outside_unit_interval_is_unknown_and_counted(ratio: str) -> None:
    slots, props, metrics = read_case("llamacpp-pre13660")
    assert metrics is not None
    metrics = metrics.replace("llamacpp:kv_cache_usage_ratio 0.389038", f"llamacpp:kv_cache_usage_ratio {ratio}")
    facts = llamacpp_facts(parse_slots(slots), parse_props(props), parse_metrics(metrics), CASES["llamacpp-pre13660"])
    assert facts.pools[0].engine_reported_used_blocks is None
    assert facts.pools[0].source_violations == (USAGE_CHECK,)
    assert USAGE_CHECK in _accounts(facts, CASES["llamacpp-pre13660"]).invariant_violations


# ---------------------------------------------------------------- errors name what was wrong


SLOT = {"id": 0, "n_ctx": 512, "is_processing": False}


@pytest.mark.parametrize(
    ("body", "reason", "message"),
    [
        (b"<html>busy</html>", "parse", "/slots: not JSON"),
        (b'{"error": {"code": 501}}', "schema", "/slots: expected an array of slots, got an object"),
        (b"[]", "schema", "/slots: the server lists no slot"),
        (b"[1]", "schema", "/slots[0]: expected an object, got the integer 1"),
        (json.dumps([{**SLOT, "n_ctx": 0}]).encode(), "schema", "/slots[0].n_ctx: expected an integer in [1, 1073741824], got the integer 0"),
        (json.dumps([{**SLOT, "n_ctx": 2.5}]).encode(), "schema", "/slots[0].n_ctx: expected an integer in [1, 1073741824], got the number 2.5"),
        (json.dumps([{**SLOT, "n_ctx": 2**40}]).encode(), "schema", "/slots[0].n_ctx: expected an integer"),
        (json.dumps([{**SLOT, "is_processing": 1}]).encode(), "schema", "/slots[0].is_processing: expected true or false, got the integer 1"),
        (json.dumps([SLOT, SLOT]).encode(), "schema", "/slots[1].id: slot 0 is listed twice"),
        (json.dumps([{**SLOT, "n_prompt_tokens": -1}]).encode(), "schema", "/slots[0].n_prompt_tokens: expected an integer in [0, 1073741824], got the integer -1"),
        (json.dumps([{**SLOT, "next_token": [{"n_decoded": "7"}]}]).encode(), "schema", "/slots[0].next_token.n_decoded: expected an integer in [0, 1073741824], got a string of 1 characters"),
        (json.dumps([{k: v for k, v in SLOT.items() if k != "n_ctx"}]).encode(), "schema", "/slots[0].n_ctx: missing"),
        (b"[" * 5000, "parse", "/slots: not JSON"),
        (b'[{"id": 0, "n_ctx": 1e999, "is_processing": false}]', "parse", "/slots: not JSON"),
    ],
)
def test_bad_slots_are_errors_naming_the_field(body: bytes, reason: str, message: str) -> None:
    with pytest.raises(SourceError) as err:
        parse_slots(body)
    assert err.value.reason == reason and str(err.value).startswith(message), str(err.value)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([], "/props: expected an object, got an array of 0 items"),
        ({"total_slots": 0}, "/props.total_slots: expected an integer in [1, 65536], got the integer 0"),
        ({"default_generation_settings": {"n_ctx": "4096"}}, "/props.default_generation_settings.n_ctx: expected an integer"),
        ({"build_info": 11434}, "/props.build_info: expected a string, got the integer 11434"),
        ({"is_sleeping": "no"}, "/props.is_sleeping: expected true or false, got a string of 2 characters"),
    ],
)
def test_bad_props_are_schema_errors(doc: Any, message: str) -> None:
    with pytest.raises(SourceError) as err:
        parse_props(json.dumps(doc))
    assert err.value.reason == "schema" and str(err.value).startswith(message), str(err.value)


def test_build_info_is_bounded_and_printable() -> None:
    assert parse_props(json.dumps({"build_info": "b1-\x1b[31mred" + "x" * 1000})).build_info == "b1-[31mred" + "x" * 245  # cut to 256, then ESC dropped


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("llamacpp:prompt_tokens_total NaN", "llamacpp:prompt_tokens_total: value nan is not finite"),
        ("llamacpp:prompt_tokens_total -3", "llamacpp:prompt_tokens_total: value -3.0 is negative"),
        ("llamacpp:requests_deferred 1.5", "llamacpp:requests_deferred: value 1.5 is not a whole number"),
        ("llamacpp:requests_processing 1e300", "llamacpp:requests_processing: value 1e+300 exceeds 9007199254740991"),
        ("llamacpp:kv_cache_usage_ratio +Inf", "llamacpp:kv_cache_usage_ratio: value inf is not finite"),
    ],
)
def test_bad_metrics_values_are_parse_errors_naming_the_series(line: str, problem: str) -> None:
    with pytest.raises(SourceError) as err:
        parse_metrics(line + "\n")
    assert err.value.reason == "parse" and str(err.value) == problem


def test_repeated_unlabelled_series_is_a_parse_error() -> None:
    with pytest.raises(SourceError, match="2 samples, expected one"):
        parse_metrics("llamacpp:requests_deferred 1\nllamacpp:requests_deferred 2\n")


def test_six_significant_digits_are_taken_as_printed() -> None:
    m = parse_metrics("llamacpp:prompt_tokens_total 1.23457e+06\nllamacpp:prompt_tokens_cached_total 2.5e+06\n")
    assert (m.prompt_tokens, m.prompt_tokens_cached) == (1234570.0, 2500000.0)


# ---------------------------------------------------------------- the mapping's rules, by hand


def _slot(i: int, n_ctx: int, busy: bool, tokens: int | None, task: int | None = 1) -> dict[str, Any]:
    out: dict[str, Any] = {"id": i, "n_ctx": n_ctx, "is_processing": busy}
    if task is not None:
        out["id_task"] = task
    if tokens is not None:
        out["n_prompt_tokens"] = tokens
    return out


def _facts(slots: list[dict[str, Any]], cfg: EngineConfig | None = None, props: dict[str, Any] | None = None,
           metrics: str | None = None) -> EngineFacts:
    return llamacpp_facts(parse_slots(json.dumps(slots)), parse_props(json.dumps(props or {})),
                          None if metrics is None else parse_metrics(metrics), cfg or _cfg(block_bytes=128))


def test_split_slots_busy_in_use_idle_reclaimable_never_used_empty() -> None:
    facts = _facts([_slot(0, 512, True, 300), _slot(1, 512, False, 200), _slot(2, 512, True, 12),
                    _slot(3, 512, False, None, task=None)])
    (pool,) = facts.pools
    assert (pool.num_blocks, pool.in_use, pool.reclaimable) == (2048, 312, 200)
    assert (pool.running_requests, pool.reserved_blocks) == (2, 1024)
    acc = _accounts(facts, _cfg(block_bytes=128))
    (p,) = acc.pools
    assert p.physical.free is not None and p.physical.free.exact == 2048 - 312 - 200
    assert p.physical_headroom_blocks is not None and p.physical_headroom_blocks.exact == 2048 - 312
    assert p.capacity_bytes == 2048 * 128 and acc.facts.admission == "reserve-cap"
    assert p.admission_headroom_requests is not None and p.admission_headroom_requests.exact == 2


def test_split_reservation_is_exact_under_reference_aware_sharing_too() -> None:
    """Split slots are separate streams (shared 0): each slot's reservation counted alone is
    also the reference-aware one, so 2 busy slots x 512 stay exact under both rules."""
    facts = _facts([_slot(0, 512, True, 300), _slot(1, 512, False, 200), _slot(2, 512, True, 12)])
    assert facts.pools[0].shared == 0
    merged = merge(facts, configured_facts(_cfg(block_bytes=128)))
    for sharing in ("per-request", "reference-aware"):
        (p,) = accounts_of(Snapshot(engines=[merged], sharing=sharing)).engines[0].pools
        assert p.reserved_blocks is not None and p.reserved_blocks.exact == 1024
        assert p.quota_headroom_blocks is not None and p.quota_headroom_blocks.exact == 1536 - 1024


def test_unified_capacity_is_one_context_and_the_reservation_a_bound() -> None:
    cfg = _cfg(block_bytes=128, kv_unified=True)
    facts = _facts([_slot(i, 4096, i < 3, 1000 + i) for i in range(4)], cfg)
    (pool,) = facts.pools
    assert (pool.num_blocks, pool.in_use, pool.reclaimable, pool.reserved_blocks) == (4096, 3003, 1003, None)
    assert pool.shared is None  # sequences of one buffer may share cells
    assert facts.admission == "dynamic"
    acc = _accounts(facts, cfg)
    assert acc.facts.admission == "dynamic"
    (p,) = acc.pools
    # three busy slots, each may grow to the whole buffer: an upper bound, over capacity
    assert p.reserved_blocks is not None and p.reserved_blocks.exact is None and p.reserved_blocks.upper == 3 * 4096


def test_configured_admission_wins_over_the_layout() -> None:
    cfg = _cfg(block_bytes=128, kv_unified=True, admission="reserve-cap")
    acc = _accounts(_facts([_slot(0, 4096, True, 10)], cfg), cfg)
    assert acc.facts.admission == "reserve-cap"


def test_unreported_token_count_leaves_its_sum_unknown() -> None:
    facts = _facts([_slot(0, 512, True, 300), _slot(1, 512, False, None, task=7)])
    (pool,) = facts.pools
    assert pool.in_use == 300 and pool.reclaimable is None  # the idle slot ran a task: its tokens are unknown
    acc = _accounts(facts, _cfg(block_bytes=128))
    assert acc.pools[0].physical.reclaimable is None and acc.pools[0].physical.in_use is not None


def test_more_tokens_than_the_slot_context_is_unknown_and_counted() -> None:
    facts = _facts([_slot(0, 512, True, 513), _slot(1, 512, False, 10)])
    (pool,) = facts.pools
    assert (pool.in_use, pool.reclaimable, pool.source_violations) == (None, None, (TOKENS_CHECK,))
    acc = _accounts(facts, _cfg(block_bytes=128))
    assert TOKENS_CHECK in acc.invariant_violations and acc.pools[0].physical.in_use is None
    assert acc.pools[0].reserved_blocks is not None and acc.pools[0].reserved_blocks.exact == 512


def test_sleeping_server_has_no_pool_and_runs_nothing() -> None:
    facts = llamacpp_facts(None, parse_props(json.dumps({"is_sleeping": True, "build_info": "b1-x"})),
                           parse_metrics("llamacpp:requests_deferred 0\n"), _cfg())
    assert facts.pools == [] and facts.request_counts is not None
    assert (facts.request_counts.running, facts.request_counts.waiting) == (0, 0)


def test_prefix_cache_counters_from_current_builds() -> None:
    facts = _facts([_slot(0, 512, False, 0)], metrics=(
        "llamacpp:prompt_tokens_total 900\nllamacpp:prompt_tokens_cached_total 300\nllamacpp:requests_deferred 4\n"))
    assert facts.counters == {"prefix_cache_hit_tokens": 300.0, "prefix_cache_queried_tokens": 1200.0}
    assert facts.request_counts is not None and facts.request_counts.waiting == 4


def test_block_bytes_from_a_model_config(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
                                  "hidden_size": 2048, "head_dim": 64, "torch_dtype": "bfloat16"}))
    from kvledger.config.types import ModelDerivation

    facts = _facts([_slot(0, 512, False, 0)], _cfg(model=ModelDerivation(str(config))))
    assert facts.pools[0].block_bytes == 16 * 2 * 8 * 64 * 2  # per token: layers x (K, V) x heads x dims x bf16


def test_capacity_overflowing_a_float_is_a_config_error() -> None:
    with pytest.raises(SourceError) as err:
        _facts([_slot(0, 2**30, False, 0)], _cfg(block_bytes=2**30))
    assert err.value.reason == "config" and "bytes per token" in str(err.value)


def test_engine_reservation_below_in_use_is_unknown_and_counted() -> None:
    facts = _facts([_slot(0, 512, True, 100)])
    facts.pools[0].reserved_blocks = 50  # an engine claiming to reserve less than it holds
    acc = _accounts(facts, _cfg(block_bytes=128))
    assert ENGINE_RESERVED_CHECK in acc.invariant_violations
    # the engine's figure is dropped; what the busy-slot count bounds remains, as a bound
    reserved = acc.pools[0].reserved_blocks
    assert reserved is not None and reserved.exact is None and reserved.upper == 512
    assert acc.pools[0].physical.in_use is not None
