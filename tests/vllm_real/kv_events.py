"""Receive vLLM KV events over real ZMQ sockets, for tests and fixture capture.

This is test tooling, independent of the kvledger adapter that it helps verify: it keeps
each message as received (topic, sequence number, msgpack payload decoded) and offers the
few views the tests need.

Wire format (vLLM's ZmqEventPublisher): PUB frames ``[topic, seq (8 bytes, big-endian),
payload]``; the payload is a msgpack ``[ts, [events...], dp_rank]``. Replay: a DEALER sends
``[b"", start_seq]`` to the ROUTER and receives ``[b"", topic, seq, payload]`` per buffered
batch, then ``[b"", b"", seq -1, b""]``.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

END_SEQ = -1


@dataclass(frozen=True)
class EventBatch:
    topic: str
    seq: int
    payload: bytes

    @property
    def batch(self) -> list[Any]:
        """The decoded ``[ts, [events], dp_rank]``."""
        return msgpack.unpackb(self.payload, raw=False, strict_map_key=False)

    @property
    def events(self) -> list[Any]:
        return list(self.batch[1])

    def as_json_record(self) -> dict[str, Any]:
        """The line format of tests/fixtures/vllm/*-kv-events.jsonl."""
        return {"topic": self.topic, "seq": self.seq, "batch": self.batch}


def decode_frames(frames: list[bytes]) -> EventBatch:
    if len(frames) != 3:
        raise ValueError(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    topic, seq, payload = frames
    if len(seq) != 8:
        raise ValueError(f"sequence frame has {len(seq)} bytes, expected 8")
    return EventBatch(topic.decode(), int.from_bytes(seq, "big", signed=True), payload)


class KvEventSubscriber:
    """A SUB socket connected to ``url`` that collects batches in a background thread.

    ZMQ reconnects by itself, so one subscriber follows the server across restarts.
    """

    def __init__(self, url: str, topic: str = "") -> None:
        self.url = url
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        # the connection's handshake, reported by ZMQ: the subscription goes out with it
        # (a PUB drops what it sends before a subscriber has joined)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self._joined = threading.Event()
        self._sock.connect(url)
        self._lock = threading.Lock()
        self._batches: list[EventBatch] = []
        self._errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-sub", daemon=True)
        self._thread.start()

    def wait_joined(self, timeout: float = 30.0) -> None:
        """Wait until the SUB connection to the publisher has completed its handshake (ZMQ's
        monitor event), so that what the publisher sends from then on reaches it; the timeout
        only bounds a failure (no publisher listening)."""
        if not self._joined.wait(timeout):
            raise TimeoutError(f"KV events from {self.url}: no connection to the publisher after {timeout} s")

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(100))
            if self._monitor in ready:
                if recv_monitor_message(self._monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._joined.set()
            if self._sock not in ready:
                continue
            frames = self._sock.recv_multipart()
            try:
                batch = decode_frames(frames)
            except ValueError as err:
                with self._lock:
                    self._errors.append(str(err))
                continue
            with self._lock:
                self._batches.append(batch)

    def batches(self) -> list[EventBatch]:
        with self._lock:
            return list(self._batches)

    def errors(self) -> list[str]:
        with self._lock:
            return list(self._errors)

    def clear(self) -> None:
        with self._lock:
            self._batches.clear()

    def wait_for(
        self, predicate: Callable[[list[EventBatch]], bool], timeout: float = 30.0
    ) -> list[EventBatch]:
        """Wait until ``predicate(batches)`` holds; raise TimeoutError with what arrived."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.batches()
            if predicate(got):
                return got
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"KV events from {self.url}: condition not met after {timeout} s "
                    f"({len(got)} batches received)"
                )
            time.sleep(0.05)

    def wait_quiet(self, quiet: float = 1.0, timeout: float = 30.0) -> list[EventBatch]:
        """Wait until no batch has arrived for ``quiet`` seconds."""
        deadline = time.monotonic() + timeout
        count, since = len(self.batches()), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.05)
            now_count = len(self.batches())
            if now_count != count:
                count, since = now_count, time.monotonic()
            elif time.monotonic() - since >= quiet:
                return self.batches()
        raise TimeoutError(f"KV events from {self.url} still arriving after {timeout} s")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close(0)

    def __enter__(self) -> KvEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def replay(url: str, start_seq: int = 0, timeout: float = 10.0) -> list[EventBatch]:
    """Ask the replay ROUTER at ``url`` for every buffered batch with seq >= start_seq."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
    try:
        sock.connect(url)
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out: list[EventBatch] = []
        while True:
            try:
                frames = sock.recv_multipart()
            except zmq.Again as err:
                raise TimeoutError(f"replay from {url}: no end marker after {timeout} s") from err
            if len(frames) != 4 or frames[0] != b"":
                raise ValueError(f"replay from {url}: unexpected frames {frames!r}")
            batch = decode_frames(frames[1:])
            if batch.seq == END_SEQ:
                return out
            out.append(batch)
    finally:
        sock.close(0)


def iter_events(batches: Iterable[EventBatch]) -> Iterable[dict[str, Any]]:
    for batch in sorted(batches, key=lambda b: b.seq):
        yield from batch.events


def cached_hashes(batches: Iterable[EventBatch]) -> Counter[int]:
    """The multiset of block hashes stored and not yet removed, in sequence order."""
    cached: Counter[int] = Counter()
    for event in iter_events(batches):
        kind = event["type"]
        if kind == "BlockStored":
            cached.update(event["block_hashes"])
        elif kind == "BlockRemoved":
            cached.subtract(event["block_hashes"])
            cached = +cached  # drop zero and negative counts
        elif kind == "AllBlocksCleared":
            cached.clear()
    return cached
