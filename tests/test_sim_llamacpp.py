"""The simulated llama.cpp server (kvledger.sim.llamacpp_server): llama.cpp's slot rules,
and its answers read through the real ``kind: llamacpp`` source."""

from __future__ import annotations

import json
import time

from accounting_support import accounts_of

from kvledger.collect.merge import configured_facts, merge
from kvledger.collect.sources.llamacpp.documents import parse_props, parse_slots
from kvledger.collect.sources.llamacpp.metrics import parse_metrics
from kvledger.collect.sources.llamacpp.source import LlamacppSource
from kvledger.domain.facts import Snapshot
from kvledger.sim.demo import llamacpp_engine_config
from kvledger.sim.llamacpp_server import SimLlamacpp, SimLlamacppProfile

QUIET = SimLlamacppProfile(slots=2, n_ctx=512, n_batch=64, arrival_rate=0.0)


def run(sim: SimLlamacpp, steps: int) -> None:
    for _ in range(steps):
        sim.step(0.0)


def test_a_request_takes_a_slot_evaluates_its_prompt_then_generates() -> None:
    sim = SimLlamacpp(QUIET)
    sim.submit([("system0", 100), ("user1", 28)], n_predict=10)
    run(sim, 1)
    (slot, _) = parse_slots(json.dumps(sim.slots_json()))
    assert slot.processing and slot.tokens == 64  # one batch of the prompt
    run(sim, 1)
    assert parse_slots(json.dumps(sim.slots_json()))[0].tokens == 128
    run(sim, 10)  # 10 tokens generated: done, idle, tokens kept for reuse
    slot = parse_slots(json.dumps(sim.slots_json()))[0]
    assert not slot.processing and slot.tokens == 128 + 10 and slot.decoded == 10
    m = parse_metrics(sim.metrics_text())
    assert (m.prompt_tokens, m.prompt_tokens_cached, m.processing, m.deferred) == (128, 0, 0, 0)


def test_a_shared_prefix_reuses_the_slot_that_holds_it() -> None:
    sim = SimLlamacpp(QUIET)
    sim.submit([("system0", 100), ("user1", 28)], n_predict=2)
    run(sim, 4)
    sim.submit([("system0", 100), ("user2", 40)], n_predict=2)
    run(sim, 1)
    slots = parse_slots(json.dumps(sim.slots_json()))
    busy = [s for s in slots if s.processing]
    assert [s.id for s in busy] == [0] and busy[0].prompt_cached == 100  # the system prompt came from the cache
    assert parse_metrics(sim.metrics_text()).prompt_tokens_cached == 100


def test_requests_wait_for_a_free_slot_and_oversized_prompts_are_refused() -> None:
    sim = SimLlamacpp(QUIET)
    for i in range(3):
        sim.submit([(f"user{i}", 10)], n_predict=50)
    assert sim.submit([("huge", 512)], n_predict=1) is None and sim.rejected == 1
    run(sim, 1)
    m = parse_metrics(sim.metrics_text())
    assert (m.processing, m.deferred) == (2, 1)


def test_the_demo_engine_reads_exact_through_the_source() -> None:
    with SimLlamacpp(SimLlamacppProfile(step_seconds=0.005, arrival_rate=4.0), seed=3) as sim:
        cfg = llamacpp_engine_config(sim)
        assert cfg.kind == "llamacpp" and cfg.url.endswith("/metrics") and cfg.block_bytes == sim.profile.block_bytes
        source = LlamacppSource(cfg)
        try:
            seen_busy = seen_idle_tokens = False
            deadline = time.monotonic() + 20
            while not (seen_busy and seen_idle_tokens) and time.monotonic() < deadline:
                facts = source.poll().facts
                pool = facts.pools[0]
                assert pool.num_blocks == 4 * 2048 and pool.in_use is not None and pool.reclaimable is not None
                assert pool.reserved_blocks == 2048 * (pool.running_requests or 0)
                acc = accounts_of(Snapshot(engines=[merge(facts, configured_facts(cfg))])).engines[0]
                assert acc.invariant_violations == []
                free = acc.pools[0].physical.free
                assert free is not None and free.exact == pool.num_blocks - pool.in_use - pool.reclaimable
                seen_busy |= (pool.running_requests or 0) > 0
                seen_idle_tokens |= pool.reclaimable > 0
                time.sleep(0.05)
            assert seen_busy and seen_idle_tokens
            assert parse_props(json.dumps(sim.props_json())).build_info == "b11434-sim"
        finally:
            source.close()
