"""Facts about a real vLLM engine that the kvledger vLLM adapter relies on.

One tiny model, one server (128 blocks of 32 tokens): a burst of concurrent requests with a
shared prefix fills the pool, preempts and evicts; the tests read what the engine itself
reports over /metrics, the KV event stream (ZMQ SUB) and its replay (ZMQ DEALER).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from .kv_events import EventBatch, KvEventSubscriber, cached_hashes, iter_events, replay
from .prom_text import labels_of, samples, value
from .server import (
    BLOCK_SIZE,
    KV_CACHE_MEMORY_BYTES,
    KV_EVENTS_TOPIC,
    NUM_GPU_BLOCKS,
    SERVED_MODEL_NAME,
    BurstResult,
    VllmServer,
    shared_prefix_ids,
    words,
)

pytestmark = pytest.mark.vllm

BURST_REQUESTS = 8
BURST_MAX_TOKENS = 600
EVENT_TYPES = {"BlockStored", "BlockRemoved", "AllBlocksCleared"}


@dataclass
class BurstRun:
    metrics_before: str
    burst: BurstResult
    metrics_idle: str
    live: list[EventBatch]
    replayed: list[EventBatch]


@pytest.fixture(scope="module")
def burst_run(vllm_server: VllmServer) -> Iterator[BurstRun]:
    with KvEventSubscriber(vllm_server.events_url) as sub:
        sub.wait_joined()  # ZMQ drops what is published before a subscriber has joined
        before = vllm_server.wait_idle()
        burst = vllm_server.burst(requests=BURST_REQUESTS, max_tokens=BURST_MAX_TOKENS)
        idle = vllm_server.wait_idle()
        live = sub.wait_quiet(quiet=1.0)
        assert not sub.errors(), sub.errors()
        yield BurstRun(before, burst, idle, live, replay(vllm_server.replay_url, 0))


def test_cache_config_info_describes_the_pool(vllm_server: VllmServer) -> None:
    info = labels_of(vllm_server.metrics_text(), "vllm:cache_config_info")
    assert info["num_gpu_blocks"] == str(NUM_GPU_BLOCKS)
    assert info["block_size"] == str(BLOCK_SIZE)
    assert info["kv_cache_memory_bytes"] == str(KV_CACHE_MEMORY_BYTES)
    assert info["kv_cache_size_tokens"] == str(NUM_GPU_BLOCKS * BLOCK_SIZE)
    assert info["enable_prefix_caching"] == "True"
    assert info["engine"] == "0"
    # Unlike the gauges, the info metric has no model_name label: join it on engine.
    assert "model_name" not in info


def test_burst_requests_all_complete(burst_run: BurstRun) -> None:
    results = burst_run.burst.results
    assert [r.status for r in results] == [200] * BURST_REQUESTS, results[0].body[:300]
    assert {r.completion_tokens for r in results} == {BURST_MAX_TOKENS}


def test_usage_rises_during_burst_and_reads_zero_before(burst_run: BurstRun) -> None:
    assert value(burst_run.metrics_before, "vllm:kv_cache_usage_perc") == 0.0
    usage = [value(text, "vllm:kv_cache_usage_perc") for text in burst_run.burst.metrics_samples]
    # The burst needs more blocks than the pool holds: at its peak most of it is in use.
    assert 0.5 < max(usage) <= 1.0, f"usage in {len(usage)} samples during the burst: {usage}"


def test_burst_preempts(burst_run: BurstRun) -> None:
    before = value(burst_run.metrics_before, "vllm:num_preemptions_total")
    after = value(burst_run.metrics_idle, "vllm:num_preemptions_total")
    assert after > before


def test_gauges_carry_engine_and_model_labels(burst_run: BurstRun) -> None:
    for name in (
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_preemptions_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
    ):
        found = samples(burst_run.metrics_idle, name)
        assert [lab for lab, _ in found] == [{"engine": "0", "model_name": SERVED_MODEL_NAME}]
    by_reason = samples(burst_run.metrics_idle, "vllm:num_requests_waiting_by_reason")
    reasons = {lab["reason"] for lab, _ in by_reason}
    assert "capacity" in reasons
    # The shared prefix is served from the prefix cache for the later requests.
    assert value(burst_run.metrics_idle, "vllm:prefix_cache_hits_total") > 0


def test_live_events_are_map_encoded_batches(burst_run: BurstRun) -> None:
    live = burst_run.live
    assert live, "no KV event batch arrived on the SUB socket during the burst"
    seqs = [b.seq for b in live]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "gap in live sequence numbers"
    for b in live:
        assert b.topic == KV_EVENTS_TOPIC
        ts, events, dp_rank = b.batch
        assert isinstance(ts, float) and isinstance(events, list) and dp_rank == 0
        for ev in events:
            assert isinstance(ev, dict), f"event not a map: {ev!r}"
            assert ev["type"] in EVENT_TYPES
            if ev["type"] == "BlockStored":
                assert ev["block_size"] == BLOCK_SIZE
                assert len(ev["token_ids"]) == BLOCK_SIZE * len(ev["block_hashes"])
                assert all(isinstance(h, int) for h in ev["block_hashes"])
                assert ev["medium"] == "GPU"
                assert {"parent_block_hash", "lora_id", "group_idx"} <= ev.keys()
            elif ev["type"] == "BlockRemoved":
                assert all(isinstance(h, int) for h in ev["block_hashes"])


def test_shared_prefix_is_stored_as_a_hash_chain(burst_run: BurstRun) -> None:
    prefix_blocks = len(shared_prefix_ids(256)) // BLOCK_SIZE
    prefix = shared_prefix_ids(prefix_blocks * BLOCK_SIZE)
    stored = [ev for ev in iter_events(burst_run.replayed) if ev["type"] == "BlockStored"]
    first = [ev for ev in stored if ev["token_ids"][: len(prefix)] == prefix]
    assert first, "the shared prefix was never stored as one BlockStored"
    assert first[0]["parent_block_hash"] is None
    # The prefix, once cached, is not stored again by the other requests of the burst.
    assert len({tuple(ev["block_hashes"][:prefix_blocks]) for ev in first}) == 1


def test_evictions_emit_block_removed(burst_run: BurstRun) -> None:
    kinds = [ev["type"] for ev in iter_events(burst_run.replayed)]
    assert "BlockRemoved" in kinds


def test_idle_usage_is_zero_while_prefix_cache_holds_blocks(burst_run: BurstRun) -> None:
    assert value(burst_run.metrics_idle, "vllm:kv_cache_usage_perc") == 0.0
    cached = cached_hashes(burst_run.replayed)
    assert 0 < sum(cached.values()) <= NUM_GPU_BLOCKS - 1  # block 0 is vLLM's null block


def test_replay_returns_the_live_batches(vllm_server: VllmServer, burst_run: BurstRun) -> None:
    replayed = {b.seq: b for b in burst_run.replayed}
    assert sorted(replayed) == list(range(len(replayed)))  # complete history from seq 0
    for b in burst_run.live:
        assert replayed[b.seq].payload == b.payload
    middle = burst_run.live[len(burst_run.live) // 2].seq
    tail = replay(vllm_server.replay_url, middle)
    assert tail[0].seq == middle
    assert [b.payload for b in tail[: len(replayed) - middle]] == [
        replayed[s].payload for s in range(middle, len(replayed))
    ]


def test_reset_prefix_cache_emits_all_blocks_cleared(vllm_server: VllmServer) -> None:
    vllm_server.wait_idle()
    next_seq = replay(vllm_server.replay_url, 0)[-1].seq + 1
    vllm_server.reset_prefix_cache()
    # AllBlocksCleared is published with the next engine step: make one.
    assert vllm_server.complete(words(range(3, 3 + 2 * BLOCK_SIZE)), 8).status == 200
    deadline = time.monotonic() + 30
    while not (since := replay(vllm_server.replay_url, next_seq)):
        assert time.monotonic() < deadline, "no KV event after the reset"
        time.sleep(0.1)
    kinds = [ev["type"] for ev in iter_events(since)]
    assert kinds[0] == "AllBlocksCleared"
    after = cached_hashes(replay(vllm_server.replay_url, 0))
    assert 0 < sum(after.values()) <= 2  # only the new request's full blocks


@pytest.mark.fresh_engine("restarts the shared server: a new run's event sequence and counters are the test")
def test_restart_resets_sequence_and_counters(vllm_server: VllmServer) -> None:
    before = replay(vllm_server.replay_url, 0)
    assert before and before[-1].seq > 0
    with KvEventSubscriber(vllm_server.events_url) as sub:
        vllm_server.restart()  # the SUB socket reconnects by itself
        sub.clear()
        assert vllm_server.complete(words(range(3, 3 + 2 * BLOCK_SIZE)), 40).status == 200
        got = sub.wait_for(lambda bs: len(bs) > 0)
        # the live stream went back (the SUB socket may reconnect a batch or two late;
        # the replay below shows the new run starting at 0)
        assert got[0].seq < before[-1].seq
    replayed = replay(vllm_server.replay_url, 0)
    assert replayed[0].seq == 0
    assert len(replayed) < len(before)
    text = vllm_server.wait_idle()
    assert value(text, "vllm:num_preemptions_total") == 0.0
    assert labels_of(text, "vllm:cache_config_info")["num_gpu_blocks"] == str(NUM_GPU_BLOCKS)
