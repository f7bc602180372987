"""vLLM KV events (ZMQ): a sequence-checked multiset of cached block hashes per DP rank.

Wire format (vLLM 0.10 to current): multipart ``[topic, seq (8-byte big-endian), payload]``
on a PUB socket; payload = msgpack ``[ts, [events...], dp_rank]`` (``dp_rank`` absent -> 0).
Events are arrays tagged by their first element in 0.10-0.12
(``["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium]``, trailing
fields optional) and maps with a ``"type"`` key in current releases; unknown fields are
ignored, hashes are ints or bytes. Replay: a DEALER sends ``[b"", start_seq]`` to the
ROUTER and receives ``[b"", (topic,) seq, payload]`` per stored batch, then seq -1.

Each DP rank publishes on the endpoint's port + rank (and replays on replay port + rank),
with its own sequence numbers. Per rank the ledger keeps a Counter of block hashes
(keyed by KV-cache group) and whether that count can be trusted:

- first message at seq 0, or a replay from seq 0 -> trusted;
- first message later than 0 with no full replay -> untrusted (subscribed mid-stream);
- a gap (seq skips) -> replay from last + 1 when a replay endpoint is configured; what it
  cannot fill is counted in ``lost`` and makes the count untrusted;
- seq going back (below last + 1) -> the server restarted: the multiset is cleared,
  ``restarts`` counted, trusted again from a fresh seq 0;
- ``AllBlocksCleared`` -> cleared and trusted again;
- ``engine_restarted(started_at)`` (the source saw the engine's process start time change)
  -> a multiset still holding batches published before ``started_at`` is dropped: a
  restarted engine's cache is empty, and an idle one publishes nothing that would reveal
  the restart through the sequence numbers. The count is rebuilt from the new run's replay
  (from seq 0) when a replay endpoint is configured, else it waits for the new run's seq 0.

Only GPU-medium events (``medium`` "GPU" or absent) change the multiset; every decoded
event is counted by type (BlockStored, BlockRemoved, AllBlocksCleared, other).

Untrusted input is bounded: a payload over ``MAX_PAYLOAD_BYTES``, an array over
``MAX_ARRAY_LEN`` items (hashes, token ids), a map over ``MAX_MAP_LEN`` keys, a hash
nested deeper than one array, a dp_rank above ``MAX_DP_RANK`` or a negative live sequence
number is a decode error (counted in ``decode_errors``, the batch counted lost, the
counts distrusted); a rank whose multiset would exceed ``MAX_TRACKED_BLOCKS`` distinct
hashes is cleared and distrusted (counted in ``overflows``) instead of growing without
bound. Decoding raises only ``EventDecodeError``.
"""

from __future__ import annotations

import logging
import math
import queue
import re
import reprlib
import threading
from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

log = logging.getLogger(__name__)

KNOWN_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
END_SEQ = -1
GPU_MEDIA = (None, "GPU", "gpu", "cuda")
#: bounds on untrusted payloads (vLLM's batches per scheduler step are far smaller)
MAX_PAYLOAD_BYTES = 4 << 20
MAX_ARRAY_LEN = 1 << 20
MAX_MAP_LEN = 1 << 10
MAX_DP_RANK = 1023
#: distinct cached hashes kept per rank (a GPU pool has far fewer blocks)
MAX_TRACKED_BLOCKS = 1 << 22

_brief = reprlib.Repr()
_brief.maxlevel, _brief.maxstring, _brief.maxother, _brief.maxlist, _brief.maxdict = 3, 40, 40, 6, 4

ReplayFn = Callable[[int, int], Iterable[tuple[int, bytes]]]  # (rank, start_seq) -> (seq, payload)...


class EventDecodeError(ValueError):
    """A KV-event payload that does not decode; the message says what was wrong."""


class ReplayError(RuntimeError):
    """The replay endpoint did not give the requested history."""


@dataclass(frozen=True, slots=True)
class KvEvent:
    type: str
    hashes: tuple[Hashable, ...] = ()
    medium: str | None = None
    group: int = 0


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float | None
    events: tuple[KvEvent, ...]
    dp_rank: int


def _scalar_hash(h: Any) -> Hashable:
    if isinstance(h, (int, bytes, str)) and not isinstance(h, bool):
        return h
    raise EventDecodeError(f"block hash of unexpected type {type(h).__name__}: {_brief.repr(h)}")


def _hashable(h: Any) -> Hashable:
    if isinstance(h, list):  # some builds encode composite hashes as (flat) arrays
        return tuple(_scalar_hash(x) for x in h)
    return _scalar_hash(h)


def _hash_list(raw: Any, what: str) -> tuple[Hashable, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise EventDecodeError(f"{what}: block_hashes is {type(raw).__name__}, expected an array")
    return tuple(_hashable(h) for h in raw)


def _opt_str(v: Any) -> str | None:
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    return v if isinstance(v, str) else None


def _group(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def decode_event(raw: Any) -> KvEvent:
    """One event, array-tagged (0.10-0.12) or a map with "type" (current)."""
    if isinstance(raw, dict):
        kind = _opt_str(raw.get("type"))
        if kind is None:
            raise EventDecodeError(f"event map without a 'type' key: keys {sorted(map(str, raw))}")
        if kind in ("BlockStored", "BlockRemoved"):
            return KvEvent(kind, _hash_list(raw.get("block_hashes"), kind), _opt_str(raw.get("medium")),
                           _group(raw.get("group_idx")))
        return KvEvent(kind, (), _opt_str(raw.get("medium")))
    if isinstance(raw, list) and raw:
        kind = _opt_str(raw[0])
        if kind is None:
            raise EventDecodeError(f"event array whose first element is not a type name: {_brief.repr(raw[0])}")
        if kind == "BlockStored":
            # [tag, hashes, parent, token_ids, block_size, lora_id?, medium?, ...]
            medium = _opt_str(raw[6]) if len(raw) > 6 else None
            return KvEvent(kind, _hash_list(raw[1] if len(raw) > 1 else None, kind), medium)
        if kind == "BlockRemoved":
            # [tag, hashes, medium?, ...]
            medium = _opt_str(raw[2]) if len(raw) > 2 else None
            return KvEvent(kind, _hash_list(raw[1] if len(raw) > 1 else None, kind), medium)
        return KvEvent(kind)
    raise EventDecodeError(f"event is neither a tagged array nor a map: {_brief.repr(raw)}")


def decode_batch(payload: bytes) -> EventBatch:
    """A msgpack batch ``[ts, [events], dp_rank?]`` (a map with ts/events/data_parallel_rank also accepted)."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise EventDecodeError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    try:
        raw = msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=False,
            max_array_len=MAX_ARRAY_LEN,
            max_map_len=MAX_MAP_LEN,
        )
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        raise EventDecodeError(f"payload is not msgpack: {str(exc)[:200] or type(exc).__name__}") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
    else:
        raise EventDecodeError(f"batch is not [ts, [events], dp_rank]: {_brief.repr(raw)}")
    if not isinstance(events, list):
        raise EventDecodeError(f"batch events is {type(events).__name__}, expected an array")
    if rank is None:
        rank = 0
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank <= MAX_DP_RANK:
        raise EventDecodeError(f"batch dp_rank is not an integer in [0, {MAX_DP_RANK}]: {_brief.repr(rank)}")
    stamp = float(ts) if isinstance(ts, (int, float)) and not isinstance(ts, bool) else None
    return EventBatch(stamp if stamp is not None and math.isfinite(stamp) else None,
                      tuple(decode_event(e) for e in events), rank)


@dataclass(slots=True)
class _RankState:
    blocks: Counter = field(default_factory=Counter)
    last: int | None = None  # last applied seq; -1 = fresh (nothing published yet); None = never seen
    trusted: bool = False
    reason: str | None = "no event received yet"
    dup_from: int = 0  # live seqs in (dup_from, dup_upto] were already applied by a replay
    dup_upto: int | None = None
    first_ts: float | None = None  # publish time of the first batch applied since the last clear


@dataclass(frozen=True, slots=True)
class KvEventsSnapshot:
    cached_blocks: dict[int, int | None]  # per DP rank; None = cannot be trusted now
    events_by_type: dict[str, int]
    lost: int
    restarts: int
    decode_errors: int
    reasons: dict[int, str]  # why a rank's count is unknown
    received: int  # live batches received on the SUB socket (replayed ones not included)
    overflows: int = 0  # ranks cleared for holding more than MAX_TRACKED_BLOCKS hashes


class KvEventLedger:
    """The per-rank multisets and sequence bookkeeping; no sockets (replay is injected)."""

    def __init__(self, replay: ReplayFn | None = None) -> None:
        self._replay = replay
        self._ranks: dict[int, _RankState] = {}
        self._types: Counter = Counter()
        self.lost = 0
        self.restarts = 0
        self.decode_errors = 0
        self.received = 0
        self.overflows = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------ inputs
    def receive(self, seq: int, payload: bytes) -> None:
        """One live batch from the SUB socket."""
        with self._lock:
            self.received += 1
            try:
                if seq < 0:
                    raise EventDecodeError(f"negative sequence number {seq}")
                batch = decode_batch(payload)
            except EventDecodeError as exc:
                self.decode_errors += 1
                self.lost += 1
                for st in self._ranks.values():
                    self._distrust(st, f"undecodable batch at seq {seq}: {exc}")
                log.warning("KV event batch seq %d not decoded: %s", seq, exc)
                return
            self._receive(seq, batch)

    def start_from_replay(self, rank: int) -> None:
        """Initial state of ``rank`` from the replay buffer (called once when subscribing)."""
        with self._lock:
            st = self._ranks.setdefault(rank, _RankState())
            if st.last is not None or self._replay is None:
                return
            try:
                history = list(self._replay(rank, 0))
            except ReplayError as exc:
                st.reason = f"initial replay failed: {exc}"
                return
            if not history:
                st.last, st.trusted, st.reason = -1, True, None  # nothing published yet
                return
            first = history[0][0]
            st.last = first - 1
            st.trusted = first == 0
            st.reason = None if first == 0 else f"subscribed mid-stream: replay history starts at seq {first}"
            self._apply_replayed(rank, st, history, count_lost=False)
            # the SUB socket connected before the replay: its first live batches may repeat
            # replayed ones (not a restart)
            st.dup_from, st.dup_upto = first - 1, st.last

    def engine_restarted(self, started_at: float) -> list[int]:
        """The engine's process (re)started at ``started_at`` (its clock, as batch ``ts``).

        Ranks whose multiset holds batches published before that are cleared and marked
        unknown until the new run is read from its start; returns those ranks.
        """
        cleared = []
        with self._lock:
            for rank, st in sorted(self._ranks.items()):
                if not st.blocks and st.last in (None, -1):
                    continue  # nothing from the old run is held
                if st.first_ts is not None and st.first_ts >= started_at:
                    continue  # the sequence already went back: only the new run is held
                self.restarts += 1
                st.blocks.clear()
                st.first_ts = None
                st.last, st.dup_upto = None, None
                self._distrust(st, f"engine restarted (process start {started_at:.2f}): "
                                   "waiting for its new event stream")
                cleared.append(rank)
        return cleared

    # ------------------------------------------------------------ logic
    def _receive(self, seq: int, batch: EventBatch) -> None:
        rank = batch.dp_rank
        st = self._ranks.setdefault(rank, _RankState())
        if st.dup_upto is not None:
            if st.dup_from < seq <= st.dup_upto:
                return  # already applied from the replay buffer
            if seq > st.dup_upto:
                st.dup_upto = None
        seen_before = st.last is not None
        if st.last is not None and seq <= st.last:
            # Sequence went back: the publisher (the engine) restarted with an empty cache.
            self.restarts += 1
            st.blocks.clear()
            st.first_ts = None
            st.last, st.trusted, st.reason = -1, True, None
        expected = (st.last + 1) if st.last is not None else 0
        if st.last is None and seq == 0:
            st.trusted, st.reason = True, None  # subscribed before the engine's first batch
        if seq > expected:
            self._fill(rank, st, expected, seq, count_lost=seen_before)
            if st.last is not None and st.last >= seq:
                return  # the replay delivered this batch too
            if st.last is None:  # first contact mid-stream and no replay
                self._distrust(st, f"subscribed mid-stream at seq {seq} (no replay from seq 0)")
        self._apply(st, batch)
        st.last = seq

    def _fill(self, rank: int, st: _RankState, expected: int, seq: int, count_lost: bool) -> None:
        """Replay [expected, ...) when possible; count and distrust what stays missing before seq."""
        if self._replay is not None:
            try:
                history = [(s, p) for s, p in self._replay(rank, expected) if s >= expected]
            except ReplayError as exc:
                history = []
                log.warning("KV event replay from seq %d (rank %d) failed: %s", expected, rank, exc)
            if history:
                if st.last is None:
                    st.last = expected - 1
                    st.trusted = expected == 0 and history[0][0] == 0
                    if not st.trusted:
                        st.reason = f"subscribed mid-stream: replay history starts at seq {history[0][0]}"
                before = st.last
                self._apply_replayed(rank, st, history, count_lost=count_lost)
                st.dup_from, st.dup_upto = before, st.last
        applied_to = st.last if st.last is not None else expected - 1
        missing = seq - 1 - applied_to
        if missing > 0:
            if count_lost:
                self.lost += missing
            how = "no replay endpoint" if self._replay is None else "replay could not fill it"
            self._distrust(st, f"{missing} event batch(es) before seq {seq} missed on rank {rank} ({how})")

    def _apply_replayed(self, rank: int, st: _RankState, history: list[tuple[int, bytes]], count_lost: bool) -> None:
        for s, payload in sorted(history, key=lambda x: x[0]):
            assert st.last is not None
            if s <= st.last:
                continue
            if s > st.last + 1:
                if count_lost:
                    self.lost += s - st.last - 1
                self._distrust(st, f"replay history of rank {rank} skips seq {st.last + 1}..{s - 1}")
            try:
                batch = decode_batch(payload)
            except EventDecodeError as exc:
                self.decode_errors += 1
                self.lost += 1
                self._distrust(st, f"undecodable replayed batch at seq {s}: {exc}")
                st.last = s
                continue
            self._apply(st, batch)
            st.last = s

    def _apply(self, st: _RankState, batch: EventBatch) -> None:
        if st.first_ts is None:
            st.first_ts = batch.ts
        for ev in batch.events:
            self._types[ev.type if ev.type in KNOWN_TYPES else "other"] += 1
            if ev.medium not in GPU_MEDIA:
                continue
            if ev.type == "BlockStored":
                for h in ev.hashes:
                    st.blocks[(ev.group, h)] += 1
                if len(st.blocks) > MAX_TRACKED_BLOCKS:
                    self.overflows += 1
                    st.blocks.clear()
                    st.first_ts = None
                    self._distrust(st, f"more than {MAX_TRACKED_BLOCKS} distinct cached blocks: count dropped")
            elif ev.type == "BlockRemoved":
                for h in ev.hashes:
                    key = (ev.group, h)
                    if st.blocks[key] > 1:
                        st.blocks[key] -= 1
                    else:
                        st.blocks.pop(key, None)
            elif ev.type == "AllBlocksCleared":
                st.blocks.clear()
                st.first_ts = batch.ts
                st.trusted, st.reason = True, None

    @staticmethod
    def _distrust(st: _RankState, reason: str) -> None:
        st.trusted = False
        st.reason = reason

    # ------------------------------------------------------------ output
    def snapshot(self) -> KvEventsSnapshot:
        with self._lock:
            cached: dict[int, int | None] = {}
            reasons: dict[int, str] = {}
            for rank, st in sorted(self._ranks.items()):
                cached[rank] = sum(st.blocks.values()) if st.trusted else None
                if not st.trusted:
                    reasons[rank] = st.reason or "unknown"
            return KvEventsSnapshot(cached, dict(self._types), self.lost, self.restarts, self.decode_errors,
                                    reasons, self.received, self.overflows)


# ---------------------------------------------------------------- sockets

_TCP = re.compile(r"^(tcp://.*:)(\d+)$")


def offset_endpoint(endpoint: str, rank: int) -> str | None:
    """vLLM's per-DP-rank endpoint: tcp port + rank (other schemes: rank 0 only)."""
    if rank == 0:
        return endpoint
    m = _TCP.match(endpoint)
    return f"{m.group(1)}{int(m.group(2)) + rank}" if m else None


def _seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise EventDecodeError(f"sequence frame has {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big", signed=True)


class KvEventSubscriber:
    """A background thread: SUB on the event endpoint(s), DEALER replays; never blocks callers."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        replay_timeout: float = 2.0,
        max_replay_batches: int = 100_000,
        poll_interval: float = 0.1,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.replay_timeout = replay_timeout
        self.max_replay_batches = max_replay_batches
        self.poll_interval = poll_interval
        self.ledger = KvEventLedger(self._replay if replay_endpoint else None)
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        self._wanted: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._resync: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._ranks: set[int] = set()
        self._dealers: dict[int, zmq.Socket] = {}
        self._sub: zmq.Socket | None = None
        self._error: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"kv-events {endpoint}", daemon=True)

    def start(self) -> None:
        self._wanted.put(0)
        self._thread.start()

    def ensure_ranks(self, ranks: Iterable[int]) -> None:
        """Subscribe to the publishers of these DP ranks too (port + rank)."""
        for r in ranks:
            if r not in self._ranks:
                self._wanted.put(r)

    def engine_restarted(self, started_at: float) -> None:
        """Drop counts from before the engine's restart; re-read the new run from its replay."""
        for rank in self.ledger.engine_restarted(started_at):
            if self.replay_endpoint:
                self._resync.put(rank)

    def snapshot(self) -> KvEventsSnapshot:
        return self.ledger.snapshot()

    def health(self) -> tuple[bool, str | None]:
        if self._error is not None:
            return False, self._error
        if not self._thread.is_alive():
            return False, "subscriber thread not running"
        snap = self.snapshot()
        if not snap.cached_blocks:
            return False, "no KV event received yet (none published, or the publisher is unreachable)"
        if snap.reasons:
            return False, "; ".join(f"rank {r}: {why}" for r, why in sorted(snap.reasons.items()))
        return True, None

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        if not self._thread.is_alive():
            self._ctx.term()

    # ------------------------------------------------------------ thread
    def _run(self) -> None:
        try:
            self._sub = self._ctx.socket(zmq.SUB)
            self._sub.setsockopt(zmq.LINGER, 0)
            self._sub.setsockopt(zmq.SUBSCRIBE, b"")
            poller = zmq.Poller()
            poller.register(self._sub, zmq.POLLIN)
            while not self._stop.is_set():
                self._connect_wanted()
                self._replay_resyncs()
                if not poller.poll(int(self.poll_interval * 1000)):
                    continue
                while True:
                    try:
                        frames = self._sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        self._on_frames(frames)
                    except Exception:  # a decoder bug must not stop the thread: counted and logged
                        with self.ledger._lock:
                            self.ledger.decode_errors += 1
                        log.exception("KV event message not processed (counted as a decode error)")
        except zmq.ZMQError as exc:
            self._error = f"ZMQ error on {self.endpoint}: {exc}"
            log.warning("KV event subscriber stopped: %s", self._error)
        finally:
            for sock in [self._sub, *self._dealers.values()]:
                if sock is not None:
                    sock.close(linger=0)

    def _connect_wanted(self) -> None:
        while True:
            try:
                rank = self._wanted.get_nowait()
            except queue.Empty:
                return
            if rank in self._ranks:
                continue
            address = offset_endpoint(self.endpoint, rank)
            if address is None:
                log.warning("cannot derive the KV event endpoint of DP rank %d from %s", rank, self.endpoint)
                self._ranks.add(rank)
                continue
            assert self._sub is not None
            self._sub.connect(address)
            self._ranks.add(rank)
            if self.replay_endpoint:
                self.ledger.start_from_replay(rank)

    def _replay_resyncs(self) -> None:
        while True:
            try:
                rank = self._resync.get_nowait()
            except queue.Empty:
                return
            self.ledger.start_from_replay(rank)

    def _on_frames(self, frames: list[bytes]) -> None:
        try:
            if len(frames) == 3:
                seq, payload = _seq(frames[1]), frames[2]
            elif len(frames) == 2:
                seq, payload = _seq(frames[0]), frames[1]
            else:
                raise EventDecodeError(f"message has {len(frames)} frames, expected [topic, seq, payload]")
        except EventDecodeError as exc:
            with self.ledger._lock:
                self.ledger.decode_errors += 1
            log.warning("KV event message ignored: %s", exc)
            return
        self.ledger.receive(seq, payload)

    def _dealer(self, rank: int) -> zmq.Socket:
        sock = self._dealers.get(rank)
        if sock is None:
            assert self.replay_endpoint is not None
            address = offset_endpoint(self.replay_endpoint, rank)
            if address is None:
                raise ReplayError(f"no replay endpoint for DP rank {rank} derivable from {self.replay_endpoint}")
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            self._dealers[rank] = sock
        return sock

    def _drop_dealer(self, rank: int) -> None:
        sock = self._dealers.pop(rank, None)
        if sock is not None:
            sock.close(linger=0)

    def _replay(self, rank: int, start: int) -> list[tuple[int, bytes]]:
        """Runs on the subscriber thread (called by the ledger)."""
        sock = self._dealer(rank)
        out: list[tuple[int, bytes]] = []
        try:
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            while len(out) <= self.max_replay_batches:
                if not sock.poll(int(self.replay_timeout * 1000), zmq.POLLIN):
                    raise ReplayError(f"no answer from {self.replay_endpoint} within {self.replay_timeout:g}s")
                frames = sock.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) == 3:  # newer builds prefix the topic
                    frames = frames[1:]
                if len(frames) != 2:
                    raise ReplayError(f"replay message has {len(frames)} frames, expected [seq, payload]")
                seq = _seq(frames[0])
                if seq == END_SEQ:
                    return out
                out.append((seq, frames[1]))
            raise ReplayError(f"replay longer than {self.max_replay_batches} batches")
        except (ReplayError, EventDecodeError, zmq.ZMQError) as exc:
            self._drop_dealer(rank)  # late answers must not be read as the next replay's
            raise ReplayError(str(exc)) from None
