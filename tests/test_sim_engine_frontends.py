"""The simulated SGLang, trtllm-serve, Triton and TGI engines (kvledger.sim.engine_frontends)
read through the real sources over HTTP: what kvledger exports for each equals, exactly, what
the engine's true ledger holds at that moment where the engine exports it, and is a bound
containing the truth (or absent) where it does not."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from accounting_support import accounts_of

from kvledger.collect.merge import configured_facts, merge
from kvledger.collect.sources.registry import kind_source
from kvledger.config.engine_kinds import KINDS
from kvledger.domain.accounts import EngineAccount
from kvledger.domain.facts import Snapshot
from kvledger.sim.demo import demo_profiles, exposition_engine_config
from kvledger.sim.engine import SimEngine
from kvledger.sim.engine_frontends import FRONTENDS

PROFILES = {p.served_as: p for p in demo_profiles() if p.served_as in FRONTENDS}


@pytest.fixture(params=sorted(PROFILES))
def stock(request: pytest.FixtureRequest) -> Iterator[tuple[SimEngine, object, object]]:
    engine = SimEngine(PROFILES[request.param], seed=11, pid=4242)  # stepped by hand: frozen between reads
    frontend = FRONTENDS[request.param](engine).start()
    cfg = exposition_engine_config(engine, frontend)
    source = kind_source(cfg)
    try:
        yield engine, cfg, source
    finally:
        source.close()
        frontend.stop()


def test_every_simulated_engine_is_of_a_registered_kind_and_follows_its_rules() -> None:
    """The simulator takes its kinds from the registration: each frontend serves a registered
    kind with that kind's own keys, and each stock engine admits and overflows by its kind's rules."""
    assert set(FRONTENDS) <= set(KINDS)
    for kind, profile in PROFILES.items():
        options = FRONTENDS[kind](SimEngine(profile, seed=0)).options()
        assert {key for key, _ in options} <= {o.name for o in KINDS[kind].options}, kind
    stock = [p for p in demo_profiles() if p.served_as != "ledger"]
    assert stock and all((p.engine_kind, p.admission, p.overflow) == (p.served_as, KINDS[p.served_as].admission,
                                                                      KINDS[p.served_as].overflow) for p in stock)


def read(cfg, source) -> EngineAccount:  # type: ignore[no-untyped-def]
    facts = merge(source.poll().facts, configured_facts(cfg))
    return accounts_of(Snapshot(engines=[facts])).engines[0]


def test_exports_match_the_true_ledger_at_every_read(stock) -> None:  # type: ignore[no-untyped-def]
    engine, cfg, source = stock
    seen_in_use = set()
    for step in range(120):
        engine.step()
        if step % 8:
            continue
        truth = engine.ledger.pool_stats()
        doc = engine.document()
        account = read(cfg, source)
        (p,) = account.pools
        assert p.capacity_blocks == engine.profile.pools[0].num_blocks and account.invariant_violations == []
        running = sum(r["contexts"] for r in doc["requests"] if r["state"] == "running")
        kind = cfg.kind
        if kind == "tgi":
            # the reservation TGI states is the ledger's: exact, per request; nothing physical
            assert p.reserved_blocks is not None and p.reserved_blocks.exact == truth["reserved"]
            assert p.physical.in_use is None and p.physical.reclaimable is None
            seen_in_use.add(truth["reserved"])
            continue
        assert p.physical.in_use is not None and p.physical.in_use.exact == truth["in_use"]
        seen_in_use.add(truth["in_use"])
        assert p.physical_headroom_blocks is not None
        assert p.physical_headroom_blocks.exact == truth["free"] + truth["reclaimable"]
        if kind == "sglang":
            assert p.physical.reclaimable is not None and p.physical.reclaimable.exact == truth["reclaimable"]
            assert p.physical.free is not None and p.physical.free.exact == truth["free"]
            assert account.requests["running"] == running
        else:  # TensorRT-LLM: free counts reusable blocks; the truth lies within the bounds
            rec = p.physical.reclaimable
            assert rec is not None and rec.exact is None and rec.upper == truth["free"] + truth["reclaimable"]
            assert truth["reclaimable"] <= rec.upper
        # the reservation bound holds: admitted x ceil(L / B), never below in-use
        assert p.reserved_blocks is not None and p.reserved_blocks.upper is not None
        assert p.reserved_blocks.upper >= truth["in_use"]
    assert len(seen_in_use) > 2, "the engine's state moved"


def test_sglang_host_tier_counts_evictions_and_load_backs() -> None:
    engine = SimEngine(PROFILES["sglang"], seed=5)
    frontend = FRONTENDS["sglang"](engine).start()
    cfg = exposition_engine_config(engine, frontend)
    source = kind_source(cfg)
    try:
        for _ in range(400):
            engine.step()
        counters = source.poll().facts.counters  # type: ignore[attr-defined]
        page = engine.profile.pools[0].block_size
        assert counters["host_offloaded_tokens"] > 0 and counters["host_offloaded_tokens"] % page == 0
        assert counters["host_loaded_tokens"] <= counters["host_offloaded_tokens"]
        assert counters["prefix_cache_hit_tokens"] == engine.prefix_hit_tokens
        assert counters["preemptions"] == engine.ledger.counters["preemptions"]
    finally:
        source.close()
        frontend.stop()
