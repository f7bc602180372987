"""The KV-event subscriber: a background thread with a ZMQ SUB socket on the event
endpoint(s) and DEALER sockets for replays, feeding a ``KvEventState``. Each DP rank
publishes on the endpoint's port + rank and replays on the replay port + rank. Replay: a
DEALER sends ``[b"", start_seq]`` to the ROUTER and receives ``[b"", (topic,) seq,
payload]`` per stored batch, then seq -1. It never blocks its callers.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
from collections.abc import Iterable

import zmq

from kvledger.collect.sources.vllm.events_state import KvEventsSnapshot, KvEventState, ReplayError
from kvledger.collect.sources.vllm.events_wire import EventDecodeError

log = logging.getLogger(__name__)

END_SEQ = -1


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
        self.ledger = KvEventState(self._replay if replay_endpoint else None)
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        self._wanted: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._resync: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._ranks: set[int] = set()
        self._dealers: dict[int, zmq.Socket[bytes]] = {}
        self._sub: zmq.Socket[bytes] | None = None
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

    def _dealer(self, rank: int) -> zmq.Socket[bytes]:
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
