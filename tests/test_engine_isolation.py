"""One engine's facts that the policy or the renderer cannot carry fail that engine alone:
it is marked down (``invalid``), its series disappear, every other engine stays fresh,
and /metrics always renders. Label values from engine data are bounded."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
from accounting_support import accounts_of, no_render_check
from prometheus_client.parser import text_string_to_metric_families

from kvledger.collect.collector import Collector
from kvledger.collect.label_limits import LabelLimitError, limit_labels, shorten
from kvledger.collect.sources.base import Contribution, EngineContribution, GpuContribution, Source
from kvledger.config.types import LimitsConfig
from kvledger.domain.accounts import Accounts
from kvledger.domain.facts import Budgets, EngineFacts, GpuFacts, PoolFacts, RequestFacts, Snapshot, TenantQuota
from kvledger.output.prometheus import check_renderable, render_text


def healthy(name: str = "good", in_use: int = 3) -> EngineFacts:
    pool = PoolFacts(id="0", block_size=16, num_blocks=10, block_bytes=100, in_use=in_use, reclaimable=0, free=10 - in_use)
    req = RequestFacts(id="r", state="running", prompt_tokens=20, max_output_tokens=10, blocks_held=2, tenant="t")
    return EngineFacts(name=name, kind="ledger", source="ledger", pools=[pool], requests=[req],
                       budgets=Budgets(max_model_len=64), tenants=[TenantQuota("t", 10_000)])


class Facts(Source):
    kind = "ledger"

    def __init__(self, engine: str, make: Callable[[], EngineFacts]) -> None:
        self.engine = engine
        self.make = make

    def poll(self) -> Contribution:
        return EngineContribution(self.make())


# Facts that pass a parser's types but break arithmetic or rendering downstream. The
# protocol rejects these at the boundary; the collector must survive them regardless
# (a source with a bug, a future field).
def _huge_prompt() -> EngineFacts:
    e = healthy("bad")
    assert e.requests is not None
    e.requests[0] = dataclasses.replace(e.requests[0], prompt_tokens=2**70)
    return e


def _zero_model_len() -> EngineFacts:
    return dataclasses.replace(healthy("bad"), budgets=Budgets(max_model_len=0))


def _huge_block_bytes() -> EngineFacts:
    e = healthy("bad")
    e.pools[0] = dataclasses.replace(e.pools[0], block_bytes=10**400)
    return e


def _nan_counter() -> EngineFacts:
    return dataclasses.replace(healthy("bad"), counters={"preemptions": float("nan")})


def _surrogate_version() -> EngineFacts:
    return dataclasses.replace(healthy("bad"), version="\ud800")


POISONS = {
    "huge_prompt": _huge_prompt,
    "zero_model_len": _zero_model_len,
    "huge_block_bytes": _huge_block_bytes,
    "nan_counter": _nan_counter,
    "surrogate_version": _surrogate_version,
}


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text.decode()) for s in f.samples}


@pytest.mark.parametrize("poison", sorted(POISONS))
def test_poisoned_engine_fails_alone(poison: str) -> None:
    in_use = [3]
    good = Facts("good", lambda: healthy("good", in_use[0]))
    bad = Facts("bad", POISONS[poison])
    c = Collector([good, bad], base_engines=[EngineFacts(name=n, kind="ledger", source="ledger") for n in ("good", "bad")])
    acc = c.poll_once()
    health = {h.engine: h for h, _ in c.health()}
    assert health["bad"].up is False and health["bad"].reason == "invalid"
    assert health["bad"].errors == {"invalid": 1}
    message = dict((h.engine, m) for h, m in c.health())["bad"]
    assert message is not None and message.startswith("facts cannot be accounted")
    assert health["good"].up is True
    # like a source that is down: only what the configuration says of "bad" remains
    assert {e.name: len(e.pools) for e in acc.engines} == {"good": 1, "bad": 0}
    text = render_text(acc)
    s = samples(text)
    assert s[("kvledger_kv_blocks", (("engine", "good"), ("pool", "0"), ("state", "in_use")))] == 3
    assert not any(dict(k[1]).get("engine") == "bad" and k[0].startswith("kvledger_kv_") for k in s)
    assert s[("kvledger_source_up", (("engine", "bad"), ("source", "ledger")))] == 0
    # the healthy engine keeps moving, the poisoned one stays down, the counter counts polls
    in_use[0] = 5
    acc = c.poll_once()
    s = samples(render_text(acc))
    assert s[("kvledger_kv_blocks", (("engine", "good"), ("pool", "0"), ("state", "in_use")))] == 5
    assert s[("kvledger_source_errors_total", (("engine", "bad"), ("reason", "invalid"), ("source", "ledger")))] == 2
    # an invalid poll is no success: the poisoned source never shows a last success
    assert ("kvledger_source_last_success_timestamp_seconds", (("engine", "bad"), ("source", "ledger"))) not in s
    assert s[("kvledger_source_last_success_timestamp_seconds", (("engine", "good"), ("source", "ledger")))] > 0
    c.stop()


def test_engine_recovers_when_its_facts_are_sane_again() -> None:
    state = {"bad": True}
    src = Facts("e", lambda: _zero_model_len() if state["bad"] else healthy("e"))
    src.make = lambda: dataclasses.replace(_zero_model_len() if state["bad"] else healthy(), name="e")
    c = Collector([src], base_engines=[EngineFacts(name="e", kind="ledger", source="ledger")])
    assert c.poll_once().engines[0].pools == []  # only the configured facts: no pool figures
    state["bad"] = False
    acc = c.poll_once()
    assert acc.engines[0].pools[0].capacity_blocks == 10
    assert {h.engine: h.up for h, _ in c.health()} == {"e": True}
    c.stop()


class BadGpus(Source):
    kind = "nvml"

    def poll(self) -> Contribution:
        return GpuContribution([GpuFacts(0, True, "GPU-x", "H200", False, 10**400, 1, 1, 1)])


def test_gpu_facts_that_cannot_render_fail_the_gpu_source_alone() -> None:
    c = Collector([Facts("good", healthy), BadGpus()], base_engines=[])
    acc = c.poll_once()
    assert acc.gpus == []
    assert {(h.engine, h.source): h.reason for h, _ in c.health()} == {("good", "ledger"): None, ("", "nvml"): "invalid"}
    assert [e.name for e in acc.engines] == ["good"]
    render_text(acc)
    c.stop()


def test_a_bug_in_accounting_never_serves_old_numbers_as_fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    c = Collector([Facts("good", healthy)], base_engines=[], interval=0.05)
    assert c.poll_once().engines
    def broken(*_a: object) -> list[object]:
        raise RuntimeError("bug")

    monkeypatch.setattr(Collector, "_sub_health", broken)
    c.start()
    try:
        import time

        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            latest = c.latest()
            if latest is not None and not latest.engines:
                break
            time.sleep(0.02)
        latest = c.latest()
        assert latest is not None and latest.engines == []
        assert {h.engine: (h.up, h.reason) for h in latest.health} == {"good": (False, "internal")}
    finally:
        c.stop()


def test_check_renderable_names_the_family() -> None:
    acc = accounts_of(Snapshot(engines=[dataclasses.replace(healthy(), counters={"preemptions": float("inf")})]), render_check=no_render_check)
    with pytest.raises(ValueError, match="kvledger_preemptions_total"):
        check_renderable(acc)


# ---------------------------------------------------------------- label limits


def test_long_label_values_are_shortened_consistently() -> None:
    e = healthy()
    long_pool, long_tenant = "p" * 5000, "t" * 300
    assert e.requests is not None
    e.pools[0] = dataclasses.replace(e.pools[0], id=long_pool)
    e.requests[0] = dataclasses.replace(e.requests[0], pool=long_pool, tenant=long_tenant)
    e.tenants = [TenantQuota(long_tenant, 10_000)]
    e.version = "v" * (1 << 20)
    limited, counts = limit_labels(e, LimitsConfig(label_value_length=64))
    assert counts == {("version", "shortened"): 1, ("pool", "shortened"): 1, ("tenant", "shortened"): 1}
    assert len(limited.version or "") == 64 and len(limited.pools[0].id) == 64
    assert limited.requests is not None and limited.requests[0].pool == limited.pools[0].id
    assert limited.requests[0].tenant == limited.tenants[0].name
    # the request still counts against its (renamed) tenant
    acc = accounts_of(Snapshot(engines=[limited]))
    assert acc.engines[0].tenants[0].requests["running"] == 1
    assert shorten("a" * 100, 64) != shorten("a" * 99 + "b", 64)  # distinct values stay distinct
    assert e.pools[0].id == long_pool  # the input is not modified


def test_tenants_over_the_limit_are_dropped_and_counted() -> None:
    e = healthy()
    e.tenants = [TenantQuota(f"t{i:06d}", 1) for i in range(100_000)]
    limited, counts = limit_labels(e, LimitsConfig(tenants_per_engine=100))
    assert len(limited.tenants) == 100 and limited.tenants[0].name == "t000000"
    assert counts == {("tenant", "dropped"): 99_900}


def test_too_many_pools_make_the_engine_invalid() -> None:
    e = healthy()
    e.pools = [dataclasses.replace(e.pools[0], id=str(i)) for i in range(65)]
    with pytest.raises(LabelLimitError, match="65 pools") as info:
        limit_labels(e, LimitsConfig(pools_per_engine=64))
    assert info.value.counts == {("pool", "dropped"): 1}


def test_collector_counts_limited_labels_once_per_poll() -> None:
    def many_tenants() -> EngineFacts:
        e = healthy()
        e.tenants = [TenantQuota(f"t{i}", 1) for i in range(20)]
        return e

    c = Collector([Facts("good", many_tenants)], base_engines=[], limits=LimitsConfig(tenants_per_engine=5))
    c.poll_once()
    acc = c.poll_once()
    assert len(acc.engines[0].tenants) == 5
    assert acc.labels_limited == {("good", "tenant", "dropped"): 30}
    s = samples(render_text(acc))
    assert s[("kvledger_label_values_limited_total", (("action", "dropped"), ("engine", "good"), ("label", "tenant")))] == 30
    c.stop()


def test_render_survives_a_family_that_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvledger.output.prometheus as out

    # made before the family breaks, without the render check (the check makes an engine's
    # lines, and a family that raises there makes the engine invalid): the scrape makes them
    accounts = accounts_of(Snapshot(engines=[healthy()]), render_check=no_render_check)
    spec = next(s for s in out.CATALOG if s.name == "kvledger_kv_capacity_blocks")

    def boom(_a: object) -> list[object]:
        raise RuntimeError("bug")

    broken = dataclasses.replace(spec, samples=boom)
    monkeypatch.setattr(out, "CATALOG", tuple(broken if s is spec else s for s in out.CATALOG))
    monkeypatch.setattr(out, "_ENGINE_SPECS", tuple(broken if s is spec else s for s in out._ENGINE_SPECS))
    s = samples(render_text(accounts))
    assert ("kvledger_kv_capacity_blocks", (("engine", "good"), ("pool", "0"))) not in s
    assert s[("kvledger_kv_capacity_bytes", (("engine", "good"), ("pool", "0")))] == 1000


def test_a_family_that_raises_in_the_render_check_makes_the_engine_invalid(monkeypatch: pytest.MonkeyPatch) -> None:
    """The render check makes the engine's lines from the samples it checks: a family that
    raises there fails that engine's check (it is invalid), and nothing is kept on it."""
    import kvledger.output.prometheus as out

    account = accounts_of(Snapshot(engines=[healthy()]), render_check=no_render_check).engines[0]
    spec = next(s for s in out.CATALOG if s.name == "kvledger_tenant_requests")

    def boom(_a: object) -> list[object]:
        raise RuntimeError("bug")

    monkeypatch.setattr(out, "CATALOG", tuple(dataclasses.replace(spec, samples=boom) if s is spec else s
                                              for s in out.CATALOG))
    with pytest.raises(RuntimeError):
        check_renderable(Accounts([account], [], [], None, [], "per-request", 0.0))
    assert account.rendered is None
