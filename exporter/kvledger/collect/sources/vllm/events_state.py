"""The cached-block count of vLLM's KV events: per DP rank a sequence-checked multiset
of block hashes (keyed by KV-cache group) and whether that count can be trusted. No
sockets: replay is a function given to it.

- first message at seq 0, or a replay from seq 0 -> trusted;
- first message later than 0 with no full replay -> untrusted (subscribed mid-stream);
- a gap (seq skips) -> replay from last + 1 when a replay endpoint is configured; what it
  cannot fill is counted in ``lost`` and makes the count untrusted;
- seq going back (below last + 1) -> the server restarted: the multiset is cleared,
  ``restarts`` counted, trusted again from a fresh seq 0;
- a jump larger than ``MAX_SEQ_GAP`` (forward from the last seq, or from 0 after a
  restart) is no gap a subscriber can have missed but a restart or a corrupt sequence
  number: the rank is resynchronised (cleared, read again as on first contact: trusted
  once a replay from seq 0 or an ``AllBlocksCleared`` says what it holds), counted once
  in ``resyncs`` and as one lost batch, never as 2**63 lost batches;
- ``AllBlocksCleared`` -> cleared and trusted again;
- ``engine_restarted(started_at)`` (the source saw the engine's process start time change)
  -> a multiset still holding batches published before ``started_at`` is dropped: a
  restarted engine's cache is empty, and an idle one publishes nothing that would reveal
  the restart through the sequence numbers. The count is rebuilt from the new run's replay
  (from seq 0) when a replay endpoint is configured, else it waits for the new run's seq 0.

Only GPU-medium events (``medium`` "GPU" or absent) change the multiset; every decoded
event is counted by type (BlockStored, BlockRemoved, AllBlocksCleared, other). A payload
that does not decode, or a negative live sequence number, is counted in
``decode_errors`` (the batch counted lost, the counts distrusted); a rank whose multiset
would exceed ``MAX_TRACKED_BLOCKS`` distinct hashes is cleared and distrusted (counted
in ``overflows``) instead of growing without bound.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from itertools import repeat

from kvledger.collect.sources.vllm.events_wire import GPU_MEDIA, KNOWN_TYPES, EventBatch, EventDecodeError, decode_batch
from kvledger.domain.limits import MAX_KV_GROUPS

log = logging.getLogger(__name__)

#: distinct cached hashes kept per rank (a GPU pool has far fewer blocks)
MAX_TRACKED_BLOCKS = 1 << 22
#: the largest sequence gap taken as batches missed: vLLM publishes one batch per scheduler
#: step, so 2**20 batches are hours of a busy engine's stream. A larger jump is a restart
#: or a corrupt sequence number (resync); ``lost`` grows by at most this per batch received
MAX_SEQ_GAP = 1 << 20
#: KV-cache group indices kept per rank (vLLM's hybrid models have a handful)
MAX_GROUPS = MAX_KV_GROUPS

ReplayFn = Callable[[int, int], Iterable[tuple[int, bytes]]]  # (rank, start_seq) -> (seq, payload)...


class ReplayError(RuntimeError):
    """The replay endpoint did not give the requested history."""


@dataclass(slots=True)
class _RankState:
    blocks: Counter[tuple[int, Hashable]] = field(default_factory=Counter)  # (group, block hash) -> times stored
    last: int | None = None  # last applied seq; -1 = fresh (nothing published yet); None = never seen
    trusted: bool = False
    reason: str | None = "no event received yet"
    dup_from: int = 0  # live seqs in (dup_from, dup_upto] were already applied by a replay
    dup_upto: int | None = None
    first_ts: float | None = None  # publish time of the first batch applied since the last clear
    # KV-cache groups seen in this rank's BlockStored events: group index -> (spec kind, window)
    groups: dict[int, tuple[str | None, int | None]] = field(default_factory=dict)


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
    resyncs: int = 0  # sequence jumps beyond MAX_SEQ_GAP (each also one lost batch)
    # per DP rank, the KV-cache groups its events named: index -> (spec kind, sliding window)
    groups: dict[int, dict[int, tuple[str | None, int | None]]] = field(default_factory=dict)


class KvEventState:
    """The per-rank multisets and sequence bookkeeping; no sockets (replay is injected)."""

    def __init__(self, replay: ReplayFn | None = None) -> None:
        self._replay = replay
        self._ranks: dict[int, _RankState] = {}
        self._types: Counter[str] = Counter()
        self.lost = 0
        self.restarts = 0
        self.decode_errors = 0
        self.received = 0
        self.overflows = 0
        self.resyncs = 0
        self._decode_error: str | None = None  # the decode error last logged, until a batch decodes
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
                # a publisher sending garbage at every step is logged once per kind of garbage
                # (counted in decode_errors every time), not once per batch
                level = logging.DEBUG if str(exc) == self._decode_error else logging.WARNING
                log.log(level, "KV event batch seq %d not decoded: %s", seq, exc)
                self._decode_error = str(exc)
                return
            self._decode_error = None
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
        jump = None
        if st.last is not None and seq - st.last - 1 > MAX_SEQ_GAP:
            # no gap a subscriber misses: a restart or a corrupt number; read the rank again
            jump = self._resync(rank, st, seq)
            seen_before = False
        expected = (st.last + 1) if st.last is not None else 0
        if st.last is None and seq == 0:
            st.trusted, st.reason = True, None  # subscribed before the engine's first batch
        if seq > expected:
            self._fill(rank, st, expected, seq, count_lost=seen_before)
            if st.last is not None and st.last >= seq:
                return  # the replay delivered this batch too
            if st.last is None:  # first contact mid-stream and no replay
                self._distrust(st, jump or f"subscribed mid-stream at seq {seq} (no replay from seq 0)")
            elif jump is not None and not st.trusted:
                self._distrust(st, jump)
        self._apply(st, batch)
        st.last = seq

    def _resync(self, rank: int, st: _RankState, seq: int) -> str:
        """Forget ``rank`` after a sequence jump beyond ``MAX_SEQ_GAP``: counted once (one
        resync, one lost batch); the batch is then read as a first contact mid-stream.
        Returns the reason the rank's count is unknown."""
        jumped_from = st.last
        again = (st.reason or "").startswith("sequence jumped")  # logged once until the rank is read again
        self.resyncs += 1
        self.lost += 1
        st.blocks.clear()
        st.first_ts = None
        st.last, st.dup_upto = None, None
        reason = (f"sequence jumped from {jumped_from} to {seq} on rank {rank}, more than {MAX_SEQ_GAP} batches: "
                  "a restart or a corrupt number; unknown until a replay from seq 0 or AllBlocksCleared")
        self._distrust(st, reason)
        log.log(logging.DEBUG if again else logging.WARNING,
                "KV events of rank %d: sequence jumped from %s to %d (more than %d): resynchronising",
                rank, jumped_from, seq, MAX_SEQ_GAP)
        return reason

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
                    skipped = s - st.last - 1
                    if skipped > MAX_SEQ_GAP:  # no history skips that far: counted once, as a jump
                        self.resyncs += 1
                        skipped = 1
                    self.lost += skipped
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
                if (ev.group or ev.spec_kind is not None) and 0 <= ev.group < MAX_GROUPS:
                    st.groups[ev.group] = (ev.spec_kind, ev.spec_window)
                st.blocks.update(zip(repeat(ev.group), ev.hashes))  # counted in C
                if len(st.blocks) > MAX_TRACKED_BLOCKS:
                    self.overflows += 1
                    st.blocks.clear()
                    st.first_ts = None
                    self._distrust(st, f"more than {MAX_TRACKED_BLOCKS} distinct cached blocks: count dropped")
            elif ev.type == "BlockRemoved":
                blocks = st.blocks
                get = blocks.get
                for key in zip(repeat(ev.group), ev.hashes):
                    times = get(key, 0)
                    if times > 1:
                        blocks[key] = times - 1
                    else:
                        blocks.pop(key, None)
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
            groups = {rank: dict(st.groups) for rank, st in self._ranks.items() if st.groups}
            return KvEventsSnapshot(cached, dict(self._types), self.lost, self.restarts, self.decode_errors,
                                    reasons, self.received, self.overflows, self.resyncs, groups)
