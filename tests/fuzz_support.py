"""Shared checks of the fuzz suites (tests/test_fuzz_*.py).

Every parser under fuzz either raises its documented error or returns facts; accepted
facts must hold only numbers the protocol allows (``assert_facts_in_range``) and must go
through the whole pipeline: the daemon's accounting step (``accounts_of``) over a Snapshot
holding them beside a healthy engine, ``render_text``, and prometheus_client's text parser
(``assert_exports_cleanly``). Every exported number, sums and counters included, is then
within [-(2**53 - 1), 2**53 - 1], or the exposition check (``check_renderable``) refuses
the engine, which the collector marks invalid: nothing is exported rounded.

Example counts: ``FUZZ_EXAMPLES`` per test (200 by default; ``make fuzz`` sets
``KVLEDGER_FUZZ_EXAMPLES=10000``). Under ``CI`` the conftest's derandomized profile
applies, so CI replays the same examples every run.
"""

from __future__ import annotations

import dataclasses
import math
import os
from array import array
from collections.abc import Iterable, Mapping
from typing import Any

from accounting_support import accounts_of, no_render_check
from hypothesis import HealthCheck, settings
from prometheus_client.parser import text_string_to_metric_families

from kvledger.collect.accounting import alone, engine_findings
from kvledger.config.types import LimitsConfig
from kvledger.domain.accounts import Accounts, EngineAccount
from kvledger.domain.block_refs import BlockRefArray
from kvledger.domain.facts import EngineFacts, GpuFacts, PoolFacts, RequestFacts, Snapshot, SourceHealth
from kvledger.domain.limits import MAX_SAFE_INT
from kvledger.domain.request_table import RequestTable
from kvledger.output.prometheus import check_renderable, render_text

FUZZ_EXAMPLES = int(os.environ.get("KVLEDGER_FUZZ_EXAMPLES", "200"))

FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

#: values at and beyond every documented bound, and the wrong types
EXTREME_INTS = (0, 1, -1, 2, 16, 2**30, 2**30 + 1, 2**32, 2**32 + 1, 2**53 - 1, 2**53, 2**63 - 1, 2**63, 2**64, -(2**63))
EXTREME_FLOATS = (0.0, 2.0, 2.5, -0.0, -1.0, 1e-300, 1e308, -1e308, 2.0**53, 2.0**63, math.inf, -math.inf, math.nan)
EXTREME_OTHER: tuple[Any, ...] = (None, True, False, "", "x", "0", "1e308", "NaN", "x" * 5000, [], {}, [[[[1]]]], {"a": {}})
EXTREMES: tuple[Any, ...] = EXTREME_INTS + EXTREME_FLOATS + EXTREME_OTHER


class RangeError(AssertionError):
    pass


def _walk(value: Any, path: str) -> Iterable[tuple[str, Any]]:
    if isinstance(value, BlockRefArray):
        for name in ("ids", "ref_counts"):
            column: array = getattr(value, name)
            if len(column):
                yield f"{path}.{name}[max]", max(column)
        return
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _walk(getattr(value, f.name), f"{path}.{f.name}")
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _walk(v, f"{path}[{k!r}]")
        return
    if isinstance(value, (list, tuple, RequestTable)):  # a RequestTable: walked as its RequestFacts
        for i, v in enumerate(value):
            yield from _walk(v, f"{path}[{i}]")
        return
    yield path, value


def assert_facts_in_range(facts: EngineFacts) -> None:
    """Every int in [0, 2**53 - 1], every float finite and in [0, 2**53 - 1]; divisors >= 1."""
    for path, v in _walk(facts, facts.name):
        if isinstance(v, bool) or v is None or isinstance(v, (str, bytes)):
            continue
        if isinstance(v, int):
            if not 0 <= v <= MAX_SAFE_INT:
                raise RangeError(f"{path} = {v}: integer outside [0, 2**53 - 1]")
        elif isinstance(v, float):
            if not (math.isfinite(v) and 0 <= v <= MAX_SAFE_INT):
                raise RangeError(f"{path} = {v!r}: float not finite or outside [0, 2**53 - 1]")
        else:
            raise RangeError(f"{path} = {v!r}: unexpected type {type(v).__name__}")
    for pool in facts.pools:
        assert pool.block_size >= 1 and pool.num_blocks >= 1 and pool.layer_groups >= 1, pool
        assert pool.block_bytes is None or pool.block_bytes >= 1, pool
        assert pool.sliding_window is None or pool.sliding_window >= 1, pool
        assert pool.num_blocks * (pool.block_bytes or 1) <= MAX_SAFE_INT
    if facts.budgets.max_model_len is not None:
        assert facts.budgets.max_model_len >= 1


def healthy_engine() -> EngineFacts:
    pool = PoolFacts(id="0", block_size=16, num_blocks=100, block_bytes=4096, in_use=10, reclaimable=5, free=85)
    reqs = [RequestFacts(id="r", state="running", prompt_tokens=100, max_output_tokens=50, blocks_held=7, computed_tokens=100)]
    return EngineFacts(name="healthy", kind="ledger", source="ledger", admission="dynamic", pools=[pool], requests=reqs,
                       gpus=[0])


def parse_exposition_samples(body: bytes) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out.append((s.name, dict(s.labels), float(s.value)))
    return out


def assert_exports_cleanly(facts: EngineFacts, sharing: str = "per-request") -> Accounts:
    """The daemon's accounting over [facts, a healthy engine] and render_text; the exposition
    parses and every exported value is finite. Returns the accounts."""
    snapshot = Snapshot(
        engines=[facts, healthy_engine()],
        gpus=[GpuFacts(0, True, "GPU-0", "fuzz", False, 2**40, 2**39, 2**39, 0)],
        health=[SourceHealth(facts.name, facts.source, True)],
        sharing=sharing,  # type: ignore[arg-type]
    )
    accounts = accounts_of(snapshot, render_check=no_render_check)  # the check is asked below, engine by engine
    # what a cycle that makes no Accounts counts of these facts is what their account lists
    assert engine_findings(facts, LimitsConfig())[1] == accounts.engines[0].invariant_violations
    accounts.invariant_totals = {(e.name, c): 1 for e in accounts.engines for c in e.invariant_violations}
    samples = parse_exposition_samples(render_text(accounts))
    for name, labels, value in samples:
        assert math.isfinite(value), f"{name}{labels} = {value}"
    healthy = [s for s in samples if s[1].get("engine") == "healthy"]
    assert healthy, "the healthy engine lost its series"
    if not exported_alone(accounts.engines[0], snapshot):
        return accounts  # the collector marks the engine invalid: none of its numbers is exported
    for name, labels, value in samples:
        assert abs(value) <= MAX_SAFE_INT, f"{name}{labels} = {value!r}: beyond 2**53 - 1, yet renderable"
    return accounts


def exported_alone(engine: EngineAccount, snapshot: Snapshot) -> bool:
    """Whether the exposition check lets ``engine`` be exported, asked as the collector asks
    it (each engine alone, with its budget terms); False: the engine is invalid."""
    try:
        check_renderable(alone(engine, snapshot))
    except ValueError:
        return False
    return True
