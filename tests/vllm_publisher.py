"""A test stand-in for vLLM's KV event publisher (PUB + replay ROUTER) and event builders."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import msgpack
import zmq

END = (-1).to_bytes(8, "big", signed=True)


def stored_array(hashes, medium: str | None = "GPU", legacy: bool = False) -> list:
    """0.10-0.12 array-tagged BlockStored; ``legacy`` omits lora_id and medium (older builds)."""
    ev = ["BlockStored", hashes, None, [1] * 16 * len(hashes), 16]
    return ev if legacy else [*ev, None, medium]


def removed_array(hashes, medium: str | None = "GPU") -> list:
    return ["BlockRemoved", hashes] + ([] if medium is None else [medium])


def stored_map(hashes, medium: str = "GPU") -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": [],
            "block_size": 32, "lora_id": None, "medium": medium, "lora_name": None, "extra_keys": [None],
            "group_idx": 0, "kv_cache_spec_kind": "full_attention", "some_future_field": 7}


def removed_map(hashes) -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0}


CLEARED = ["AllBlocksCleared"]


class FakeVllmPublisher:
    """vLLM's ZmqEventPublisher side: XPUB (to see the subscription) and a replay ROUTER."""

    def __init__(self, replay: bool = True, topic: bytes = b"kv-events", replay_with_topic: bool = False) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.topic = topic
        self.replay_with_topic = replay_with_topic
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.lock = threading.Lock()
        self.replay_requests: list[int] = []
        self.replay_endpoint: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if replay:
            router = self.ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind("tcp://127.0.0.1:*")
            self.replay_endpoint = router.getsockopt(zmq.LAST_ENDPOINT).decode()
            self._thread = threading.Thread(target=self._serve, args=(router,), daemon=True)
            self._thread.start()

    def _serve(self, router: zmq.Socket) -> None:
        try:
            while not self._stop.is_set():
                if not router.poll(50):
                    continue
                client, _empty, start = router.recv_multipart()
                start_seq = int.from_bytes(start, "big")
                with self.lock:
                    self.replay_requests.append(start_seq)
                    items = [(s, p) for s, p in self.buffer if s >= start_seq]
                for s, p in items:
                    head = [client, b""] + ([self.topic] if self.replay_with_topic else [])
                    router.send_multipart([*head, s.to_bytes(8, "big"), p])
                router.send_multipart([client, b"", END, b""])
        finally:
            router.close(linger=0)

    def wait_subscribed(self, timeout: float = 10.0) -> None:
        assert self.pub.poll(int(timeout * 1000)), "subscriber never subscribed"
        assert self.pub.recv()[:1] == b"\x01"

    def publish(self, events: list, rank: int | None = 0, send: bool = True, as_map_batch: bool = False) -> int:
        batch: object
        if as_map_batch:
            batch = {"ts": time.time(), "events": events, "data_parallel_rank": rank}
        else:
            batch = [time.time(), events] + ([] if rank is None else [rank])
        payload = msgpack.packb(batch)
        with self.lock:
            seq = self.seq
            self.seq += 1
            self.buffer.append((seq, payload))
        if send:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def restart(self) -> None:
        """A restarted engine: a fresh publisher starts again at seq 0 with an empty buffer."""
        with self.lock:
            self.seq = 0
            self.buffer = []

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.pub.close(linger=0)
        self.ctx.term()


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def received(sub, n: int) -> None:
    wait_for(lambda: sub.snapshot().received >= n, f"{n} batches received")
