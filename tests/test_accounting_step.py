"""Accounting as a pure step (issue 21): ``account_snapshot`` turns an assembled Snapshot
into Accounts and findings without threads, polling or health; the cache is an explicit
object keyed by the very inputs an engine's facts were made from; the render check is
the output side's, passed in."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import threading

import pytest
from import_graph import parse_python

import kvledger.collect.accounting as accounting
from kvledger.collect.accounting import AccountCache, AccountKey, EngineInputs, account_snapshot
from kvledger.collect.collector import Collector
from kvledger.collect.sources.base import Contribution, EngineContribution, GpuContribution, Source
from kvledger.config.types import LimitsConfig
from kvledger.domain.accounts import Accounts
from kvledger.domain.facts import Budgets, EngineFacts, GpuFacts, PoolFacts, RequestFacts, Snapshot, TenantQuota
from kvledger.output.prometheus import check_renderable, render_text
from kvledger.policy.device_budget import budget_terms, gpu_accounts
from kvledger.policy.engine_accounts import engine_account

LIMITS = LimitsConfig()


def healthy(name: str = "good", in_use: int = 3) -> EngineFacts:
    pool = PoolFacts(id="0", block_size=16, num_blocks=10, block_bytes=100, in_use=in_use, reclaimable=0, free=10 - in_use)
    req = RequestFacts(id="r", state="running", prompt_tokens=20, max_output_tokens=10, blocks_held=2, tenant="t")
    return EngineFacts(name=name, kind="ledger", source="ledger", pools=[pool], requests=[req],
                       budgets=Budgets(max_model_len=64), tenants=[TenantQuota("t", 10_000)], gpus=[0])


def configured(name: str) -> EngineFacts:
    return EngineFacts(name=name, kind="ledger", source="ledger")


def reported(facts: EngineFacts, base: EngineFacts | None = None) -> EngineInputs:
    """Inputs of an engine a source reported (its primary facts), configured or not."""
    return EngineInputs(base, (EngineContribution(facts),))


def step(snapshot: Snapshot, inputs: dict[str, EngineInputs], cache: AccountCache | None = None,
         limits: LimitsConfig = LIMITS) -> accounting.AccountingResult:
    return account_snapshot(snapshot, inputs, limits, cache if cache is not None else AccountCache(), check_renderable)


GPU = GpuFacts(0, True, "GPU-0", "H200", False, 10**11, 10**10, 9 * 10**10)


def test_accounts_are_the_policys_for_sane_facts() -> None:
    engines = [healthy("a", 3), healthy("b", 5)]
    snapshot = Snapshot(engines=engines, gpus=[GPU], driver_version="550", sharing="reference-aware", taken_at=123.0)
    result = step(snapshot, {e.name: reported(e) for e in engines})
    terms = budget_terms(engines)  # the policy's formulas, each engine alone, then the GPUs
    expected = Accounts([engine_account(e, "reference-aware") for e in engines], gpu_accounts(snapshot, terms), terms,
                        "550", [], "reference-aware", 123.0)
    assert result.accounts == expected  # engines, GPUs, budget, driver, sharing, time; no health, no totals
    assert render_text(result.accounts) == render_text(expected)
    assert result.invalid == {} and result.gpu_error is None
    assert result.limited == {"a": {}, "b": {}} and result.invariants == {"a": [], "b": []}


def test_the_step_equals_what_the_collector_publishes() -> None:
    class Fixed(Source):
        kind = "ledger"

        def __init__(self, facts: EngineFacts) -> None:
            self.engine = facts.name
            self.contribution = EngineContribution(facts)

        def poll(self) -> Contribution:
            return self.contribution

    class Gpus(Source):
        kind = "nvml"

        def poll(self) -> Contribution:
            return GpuContribution([GPU], "550")

    good, other = healthy("good"), healthy("other", 7)
    c = Collector([Fixed(good), Fixed(other), Gpus()], base_engines=[configured("good"), configured("idle")])
    published = c.poll_once()
    c.stop()
    assert [e.name for e in published.engines] == ["good", "idle", "other"]
    snapshot, inputs, _, _ = c._assemble()
    result = step(snapshot, inputs)
    for field in ("engines", "gpus", "budget", "driver_version", "sharing"):
        assert getattr(result.accounts, field) == getattr(published, field), field


def test_an_invalid_engine_is_isolated() -> None:
    bad = dataclasses.replace(healthy("bad"), budgets=Budgets(max_model_len=0))
    nan = dataclasses.replace(healthy("nan"), counters={"preemptions": float("nan")})
    good = healthy("good")
    base_bad = configured("bad")
    snapshot = Snapshot(engines=[good, bad, nan], gpus=[GPU], taken_at=1.0)
    inputs = {"good": reported(good), "bad": reported(bad, base_bad), "nan": reported(nan)}
    before = dataclasses.replace(snapshot, engines=list(snapshot.engines))
    result = step(snapshot, inputs)
    assert set(result.invalid) == {"bad", "nan"}
    assert isinstance(result.invalid["nan"], ValueError) and "kvledger_preemptions_total" in str(result.invalid["nan"])
    # "bad" keeps what the configuration says of it; "nan", not configured, is left out
    assert [(e.name, len(e.pools)) for e in result.accounts.engines] == [("good", 1), ("bad", 0)]
    assert result.accounts.engines[0] == engine_account(good, "per-request")
    assert "bad" not in result.invariants and "nan" not in result.invariants
    assert result.gpu_error is None and len(result.accounts.gpus) == 1
    assert snapshot == before  # the Snapshot is not modified
    render_text(result.accounts)


def test_configured_facts_alone_are_never_a_fallback_for_an_unreported_engine() -> None:
    # facts the configuration and patches made, no primary source: invalid and left out
    bad = dataclasses.replace(configured("cfg"), counters={"preemptions": float("inf")})
    result = step(Snapshot(engines=[bad]), {"cfg": EngineInputs(configured("cfg"))})
    assert set(result.invalid) == {"cfg"} and result.accounts.engines == []


def test_too_many_pools_are_invalid_and_counted() -> None:
    e = healthy("e")
    e.pools = [dataclasses.replace(e.pools[0], id=str(i)) for i in range(3)]
    result = step(Snapshot(engines=[e]), {"e": reported(e, configured("e"))}, limits=LimitsConfig(pools_per_engine=2))
    assert set(result.invalid) == {"e"} and result.limited == {"e": {("pool", "dropped"): 1}}
    assert [len(a.pools) for a in result.accounts.engines] == [0]


def test_limited_labels_are_reported() -> None:
    e = healthy("e")
    e.tenants = [TenantQuota(f"t{i}", 1) for i in range(20)]
    result = step(Snapshot(engines=[e]), {"e": reported(e)}, limits=LimitsConfig(tenants_per_engine=5))
    assert result.limited == {"e": {("tenant", "dropped"): 15}} and len(result.accounts.engines[0].tenants) == 5


def test_gpu_facts_that_cannot_render_fail_the_gpus_alone() -> None:
    good = healthy("good")
    snapshot = Snapshot(engines=[good], gpus=[GpuFacts(0, True, "GPU-x", "H200", False, 10**400, 1, 1, 1)], driver_version="550")
    result = step(snapshot, {"good": reported(good)})
    assert isinstance(result.gpu_error, OverflowError)  # a byte count no float can carry
    assert result.accounts.gpus == [] and result.accounts.driver_version is None
    assert [e.name for e in result.accounts.engines] == ["good"] and result.invalid == {}


def test_the_render_check_is_the_callers() -> None:
    seen: list[Accounts] = []

    def refuse_b(accounts: Accounts) -> None:
        seen.append(accounts)
        if any(e.name == "b" for e in accounts.engines):
            raise ValueError("b cannot be rendered")

    a, b = healthy("a"), healthy("b")
    result = account_snapshot(Snapshot(engines=[a, b]), {"a": reported(a), "b": reported(b)}, LIMITS, AccountCache(), refuse_b)
    assert [e.name for e in result.accounts.engines] == ["a"] and str(result.invalid["b"]) == "b cannot be rendered"
    assert [[e.name for e in x.engines] for x in seen] == [["a"], ["b"], []]  # each engine alone, then the GPUs
    assert Collector([]).render_check is check_renderable  # the collector's default: the output side's check


def test_an_unchanged_engine_reuses_its_account() -> None:
    cache = AccountCache()
    facts, base = healthy("e"), configured("e")
    facts.pools[0] = dataclasses.replace(facts.pools[0], in_use=3, references=1)  # an invariant violation
    inputs = {"e": reported(facts, base)}
    first = step(Snapshot(engines=[dataclasses.replace(facts)]), inputs, cache)
    assert cache.engines() == ["e"] and first.invariants["e"]
    # the same input objects, freshly assembled facts: the same account object, findings again
    again = step(Snapshot(engines=[dataclasses.replace(facts)]), dict(inputs), cache)
    assert again.accounts.engines[0] is first.accounts.engines[0]
    assert again.invariants == first.invariants and again.limited == first.limited


@pytest.mark.parametrize("change", ["contribution", "configured", "sharing", "limits"])
def test_a_changed_input_is_accounted_afresh(change: str) -> None:
    cache = AccountCache()
    facts, base = healthy("e"), configured("e")
    inputs = {"e": reported(facts, base)}
    first = step(Snapshot(engines=[facts]), inputs, cache)
    snapshot, limits = Snapshot(engines=[facts]), LIMITS
    if change == "contribution":  # a new poll: a new contribution object, even with equal facts
        inputs = {"e": reported(facts, base)}
    elif change == "configured":  # a reloaded configuration
        inputs = {"e": dataclasses.replace(inputs["e"], configured=configured("e"))}
    elif change == "sharing":
        snapshot.sharing = "reference-aware"
    else:
        limits = LimitsConfig()
    second = step(snapshot, inputs, cache, limits)
    assert second.accounts.engines[0] is not first.accounts.engines[0]
    assert second.accounts.engines[0].sharing == snapshot.sharing


def test_the_cache_forgets_what_it_did_not_account() -> None:
    cache = AccountCache()
    a, b = healthy("a"), healthy("b")
    bad = dataclasses.replace(healthy("bad"), budgets=Budgets(max_model_len=0))
    inputs = {"a": reported(a), "b": reported(b), "bad": reported(bad, configured("bad"))}
    step(Snapshot(engines=[a, b, bad]), inputs, cache)
    assert cache.engines() == ["a", "b"]  # never an account of configured facts standing in
    step(Snapshot(engines=[a]), inputs, cache)
    assert cache.engines() == ["a"]


def test_the_key_compares_identity() -> None:
    c1 = EngineContribution(healthy("e"))
    c2 = EngineContribution(healthy("e"))
    assert c1 == c2  # equal by value...
    key = AccountKey(None, (c1,), "per-request", LIMITS)
    assert key.same_as(AccountKey(None, (c1,), "per-request", LIMITS))
    assert not key.same_as(AccountKey(None, (c2,), "per-request", LIMITS))  # ...yet another poll
    assert not key.same_as(AccountKey(None, (c1, c1), "per-request", LIMITS))
    assert not key.same_as(AccountKey(configured("e"), (c1,), "per-request", LIMITS))


def test_the_step_is_pure() -> None:
    source = inspect.getsource(accounting)
    imported = {
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(parse_python(source))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert not {m for m in imported if m and (m.startswith("kvledger.output") or m in ("threading", "time", "logging"))}
    threads = threading.active_count()
    e = healthy("e")
    step(Snapshot(engines=[e]), {"e": reported(e)})
    assert threading.active_count() == threads
