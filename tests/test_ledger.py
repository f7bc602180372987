import threading

import pytest
from jsonschema import Draft202012Validator
from ledger_checks import assert_consistent

from kvledger.protocol.reader import load_schema
from kvledger_engine.reference_ledger import Ledger, LedgerError, OutOfBlocks, PoolSpec

B = 16


def make(admission="dynamic", blocks=100, **kw):
    return Ledger([PoolSpec("0", B, 1024, blocks, kw.pop("sliding_window", None))], admission=admission, **kw)


def validate(doc):
    errors = list(Draft202012Validator(load_schema()).iter_errors(doc))
    assert errors == []


def test_reserve_cap_rejects_over_capacity():
    led = make("reserve-cap", blocks=100)
    assert led.admit("a", 800, 0)  # R = 50
    assert led.admit("b", 784, 16)  # R = 50 -> exactly full
    assert not led.admit("c", 1, 0)  # R = 1 would exceed
    assert led.state("c") is None  # a rejected new request is not registered
    assert led.pool_stats()["reserved"] == 100
    led.release("a")
    assert led.admit("c", 1, 0)


def test_dynamic_admits_beyond_capacity():
    led = make("dynamic", blocks=10)
    assert led.admit("a", 800, 0)
    assert led.admit("b", 800, 0)
    assert led.pool_stats()["reserved"] == 100  # overcommit is allowed and visible


def test_waiting_request_stays_waiting_when_rejected():
    led = make("reserve-cap", blocks=10)
    led.admit("a", 160, 0)
    led.submit("w", 16, 0)
    assert led.state("w") == "waiting"
    assert not led.admit("w")
    assert led.state("w") == "waiting"
    led.release("a")
    assert led.admit("w")
    assert led.state("w") == "running"


def test_raise_bound_recheck_counted():
    led = make("reserve-cap", blocks=20)
    assert led.admit("a", 160, 16)  # R = 11
    assert led.raise_bound("a", 160)  # R = 20 fits exactly
    assert not led.raise_bound("a", 176)  # R = 21 does not
    assert led.counters["admission_rechecks_accepted"] == 1
    assert led.counters["admission_rechecks_rejected"] == 1
    assert led.to_document()["requests"][0]["max_output_tokens"] == 160


def test_tenant_quota_limits_admission_under_dynamic():
    led = make("dynamic", blocks=1000, tenant_quotas={"t": 10 * 1024})  # 10 blocks of 1 KiB
    assert led.admit("a", 160, 0, tenant="t")
    assert not led.admit("b", 16, 0, tenant="t")
    assert led.admit("c", 16, 0, tenant="other")


def test_share_release_keeps_blocks_referenced_by_others_then_evict():
    led = make(blocks=10)
    led.admit("a", 64, 10)
    blocks = led.advance("a", 64)
    assert len(blocks) == 4
    led.cache(blocks, [("p", i) for i in range(4)])
    led.admit("b", 80, 10)
    hits = led.lookup([("p", 0), ("p", 1), ("p", 2), ("x", 3)])
    assert hits == blocks[:3]
    led.share("b", hits)
    assert led.pool_stats()["shared"] == 3
    led.release("a")
    s = led.pool_stats()
    assert (s["in_use"], s["reclaimable"], s["references"], s["shared"]) == (3, 1, 3, 0)
    led.release("b")
    s = led.pool_stats()
    assert (s["in_use"], s["reclaimable"], s["free"]) == (0, 4, 6)
    assert led.evict(3) == 3
    s = led.pool_stats()
    assert (s["reclaimable"], s["free"]) == (1, 9)
    assert led.lookup([("p", 0)]) == []  # evicted blocks lose their hash


def test_allocation_evicts_lru_reclaimable_and_is_all_or_nothing():
    led = make(blocks=4)
    led.admit("a", 64, 0)
    blocks = led.advance("a", 64)
    led.cache(blocks, ["h0", "h1", "h2", "h3"])
    led.release("a")
    led.admit("b", 64, 0)
    led.share("b", led.lookup(["h0"]))  # h0 is now in use, h1..h3 reclaimable
    with pytest.raises(OutOfBlocks) as err:
        led.allocate("b", 4)
    assert err.value.shortage == 1
    assert led.pool_stats()["reclaimable"] == 3  # nothing changed
    new = led.allocate("b", 2)
    assert new == [blocks[1], blocks[2]]  # least recently released first
    assert led.lookup(["h3"]) == [blocks[3]]
    assert led.lookup(["h1"]) == []


def test_advance_crosses_block_boundaries_and_counts_estimate_overflow_once():
    led = make(blocks=100)
    led.admit("a", 20, 10, output_bound="estimate")
    assert len(led.advance("a", 20)) == 2  # prompt: ceil(20/16)
    assert led.advance("a", 12) == []  # 32 tokens: still 2 blocks
    assert len(led.advance("a", 1)) == 1
    assert led.counters["reservation_overflows"] == 1  # 13 generated > estimate 10
    led.advance("a", 5)
    assert led.counters["reservation_overflows"] == 1
    led.admit("c", 16, 2)
    led.advance("c", 18)
    with pytest.raises(LedgerError, match="cap"):
        led.advance("c", 1)


def test_parallel_sampling_and_speculative_slots_stay_within_reservation():
    from kvledger.policy.reservations import reservation_blocks

    led = make(blocks=1000, max_model_len=4096)
    led.admit("a", 40, 30, contexts=3, speculative_slots=2)
    led.advance("a", 40 + 30)
    held = len(led.request_blocks("a"))
    r = reservation_blocks(40, 30, B, max_model_len=4096, contexts=3, speculative_slots=2)
    # T = ceil(72/16) = 5 blocks per context; 2 full prompt blocks shared
    assert held == r == 5 + 2 * (5 - 2)


def test_sliding_window_drops_old_blocks():
    led = make(blocks=1000, sliding_window=64)
    led.admit("a", 400, 10)
    led.advance("a", 400)
    assert len(led.request_blocks("a")) == 64 // B + 1
    assert led.pool_stats()["in_use"] == 5


def test_preempt_releases_blocks_and_counts():
    led = make(blocks=10)
    led.admit("a", 64, 10)
    led.advance("a", 64)
    led.preempt("a")
    assert led.state("a") == "preempted"
    assert led.pool_stats()["in_use"] == 0
    assert led.counters["preemptions"] == 1
    assert led.pool_stats()["reserved"] > 0  # a preempted request stays admitted
    led.resume("a")
    led.advance("a", 70)  # recomputes the prompt, then generates
    doc = led.to_document()
    assert doc["requests"][0]["generated_tokens"] == 6
    rc = make("reserve-cap")
    rc.admit("a", 16, 0)
    with pytest.raises(LedgerError):
        rc.preempt("a")


def test_forgotten_request_is_a_leak_counted_once():
    led = make("reserve-cap", blocks=10)
    led.admit("a", 160, 0)
    led.advance("a", 160)
    led.forget("a")
    doc = led.to_document()
    assert doc["requests"] == []
    assert doc["pools"][0]["blocks"]["in_use"] == 10  # the lost release still holds blocks
    assert not led.admit("b", 16, 0)  # and its reservation still counts
    assert led.sweep_leaks() == 1
    assert led.sweep_leaks() == 0
    assert led.counters["reservation_leaks"] == 1
    assert led.pool_stats()["in_use"] == 0
    assert led.admit("b", 16, 0)


def test_document_is_valid_and_agrees_with_block_refs():
    led = make(blocks=50, max_model_len=2048, max_num_seqs=8, max_num_batched_tokens=512,
               engine_kind="custom", engine_version="1.2", tenant_quotas={"t": 1 << 20})
    led.admit("a", 100, 20, tenant="t")
    blocks = led.advance("a", 100)
    led.cache(blocks[:6], [("s", i) for i in range(6)])
    led.admit("b", 100, 20, output_bound="estimate")
    led.share("b", led.lookup([("s", i) for i in range(6)]))
    led.advance("b", 100)
    led.submit("w", 10, 10)
    led.set_iteration_tokens(200)
    led.set_host(output_buffer_bytes=10, output_buffer_limit_bytes=100, output_buffer_limit_kind="hard",
                 network_queue_depth=1, network_queue_limit=10, network_queue_limit_kind="estimate")
    led.set_memory([(0, "weights", 100, "measured"), (0, "reserve", 10, "configured")])
    led.set_reported_used_blocks(12.5)
    doc = led.to_document()
    validate(doc)
    assert_consistent(doc)
    assert doc["pools"][0]["engine_reported_used_blocks"] == 12.5
    assert [r["state"] for r in doc["requests"]] == ["running", "running", "waiting"]
    small = led.to_document(include_blocks=False)
    validate(small)
    assert "block_refs" not in small["pools"][0] and "block_ids" not in small["requests"][0]


def test_render_while_mutating_from_another_thread():
    led = make(blocks=200)
    stop = threading.Event()
    docs = []

    def render():
        while not stop.is_set():
            docs.append(led.to_document())

    t = threading.Thread(target=render)
    t.start()
    try:
        for i in range(300):
            rid = f"r{i}"
            led.admit(rid, 30, 10)
            led.advance(rid, 35)
            if i >= 5:
                led.release(f"r{i - 5}")
    finally:
        stop.set()
        t.join()
    assert docs
    for doc in docs[:: max(1, len(docs) // 20)]:
        assert_consistent(doc)
